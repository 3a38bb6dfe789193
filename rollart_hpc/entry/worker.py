"""Entry point of every rank: `python -m rollart_hpc.entry.worker RUN_DIR`.

Reads the resolved config, builds the World, and enters this rank's role main for the configured job.
A rank that fails writes `failures/rank-<r>.json` (atomic; the launcher reads these to name the failing
rank and role), prints one line, and aborts the whole MPI world so that no peer waits forever. A rank that
crashes on a fatal signal prints its Python stacks first (faulthandler).
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

from rollart_hpc.cluster import lifetime, signals
from rollart_hpc.cluster.env import read_process_env, store_host
from rollart_hpc.cluster.placement import apply_placement, place_rank
from rollart_hpc.cluster.plan import make_plan
from rollart_hpc.cluster.procs import rank_exit_path
from rollart_hpc.cluster.world import World, make_world
from rollart_hpc.config import read_resolved
from rollart_hpc.config.schema import ClusterConfig, Config
from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.tasks.plugins import add_python_path

# job -> module with `main(config, world, run_dir)`: explicit, keyed by `run.job`.
JOBS: dict[str, str] = {
    "smoke": "rollart_hpc.entry.smoke",
    "rl": "rollart_hpc.entry.rl",
    "eval": "rollart_hpc.entry.eval_job",
}


def failure_path(run_dir: Path, rank: int) -> Path:
    return RunLayout(run_dir).failure(rank)


def record_failure(run_dir: Path, world: World, exc: BaseException) -> None:
    message = f"{type(exc).__name__}: {exc}"
    atomic_write_json(
        failure_path(run_dir, world.rank),
        {
            "rank": world.rank,
            "role": world.role,
            "message": message,
            "time": time.time(),
            "traceback": traceback.format_exc(),
        },
    )
    print(f"[{world.role} {world.rank}] FAILED: {message}", file=sys.stderr, flush=True)


def place(world: World, cluster: ClusterConfig) -> dict[str, object]:
    """Decide this rank's GPUs, cores and threads (`cluster.placement`), apply them, print one line."""
    needs_count = world.env.visible_gpus is None and world.plan.role_of(world.rank).resources.gpus_per_rank
    gpu_count = machine_gpu_count() if needs_count else 0
    cpus = sorted(os.sched_getaffinity(0))
    placement = place_rank(world.plan, world.rank, world.env, gpu_count, cpus, cluster.share_gpus)
    device = apply_placement(placement, cluster.require_cuda)
    print(f"[placement] {placement.describe()}", flush=True)
    return {
        "local_rank": placement.local_rank,
        "gpus": list(placement.gpu_ids),
        "device": placement.device,
        "torch_device": device,
        "cpus": list(placement.cpus),
        "threads": placement.threads,
    }


def machine_gpu_count() -> int:
    """GPUs of this machine, counted without initialising CUDA: CUDA reads CUDA_VISIBLE_DEVICES once, at
    its initialisation, and `apply_placement` still has to narrow it."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        return len(list(gpus.iterdir()))
    import torch

    return max(int(torch.cuda._device_count_nvml()), 0)  # NVML, which leaves CUDA uninitialised


def run_rank(run_dir: Path) -> int:
    config: Config = read_resolved(run_dir)
    add_python_path(config.run.python_path)  # before any module of the run's own code is imported
    plan = make_plan(config.roles)
    world = make_world(
        plan, read_process_env(), config.cluster.peer_timeout_s, store_host(config.cluster.net)
    )
    # A rank that crashes (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) prints every thread's Python stack on
    # stderr before it dies. Enabled after MPI's initialisation, whose own handler (a C backtrace) then
    # runs after this one; before the pid file, so a rank that a test can signal has it.
    faulthandler.enable(all_threads=True)
    pid_file = RunLayout(run_dir).pid_file(world.rank)
    record = {"pid": os.getpid(), "pgid": os.getpgid(0), "role": world.role, "node": world.env.node_name}
    atomic_write_json(pid_file, record)
    job = importlib.import_module(JOBS[config.run.job])
    try:
        atomic_write_json(pid_file, {**record, **place(world, config.cluster)})
        job.main(config, world, run_dir)
    except BaseException as exc:  # every failure of a rank must end the world, not leave peers waiting
        record_failure(run_dir, world, exc)
        world.comm.Abort(1)
        return 1
    atomic_write_json(rank_exit_path(run_dir, world.rank), {"code": 0, "time": time.time()})
    return 0


if __name__ == "__main__":
    signals.install()
    lifetime.bind_children()
    sys.exit(run_rank(Path(sys.argv[1])))
elif __name__ == "__mp_main__":  # a multiprocessing spawn child of a rank (dist_checkpointing's Manager)
    lifetime.die_with_parent()
