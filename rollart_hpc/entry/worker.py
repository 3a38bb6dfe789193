"""Entry point of every rank: `python -m rollart_hpc.entry.worker RUN_DIR`.

Reads the resolved config, builds the World, and enters this rank's role main for the configured job.
A rank that fails writes `failures/rank-<r>.json` (atomic; the launcher reads these to name the failing
rank and role), prints one line, and aborts the whole MPI world so that no peer waits forever.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from pathlib import Path

from rollart_hpc.cluster import signals
from rollart_hpc.cluster.env import read_process_env
from rollart_hpc.cluster.plan import make_plan
from rollart_hpc.cluster.world import World, make_world
from rollart_hpc.config import read_resolved
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.atomic import atomic_write_json

# job -> module with `main(config, world, run_dir)`: explicit, keyed by `run.job`.
JOBS: dict[str, str] = {
    "smoke": "rollart_hpc.entry.smoke",
    "rl": "rollart_hpc.entry.rl",
}


def failure_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "failures" / f"rank-{rank}.json"


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


def run_rank(run_dir: Path) -> int:
    config: Config = read_resolved(run_dir)
    plan = make_plan(config.roles)
    world = make_world(plan, read_process_env(), config.cluster.peer_timeout_s)
    pid_file = run_dir / "pids" / f"rank-{world.rank}.pid"
    atomic_write_json(pid_file, {"pid": os.getpid(), "role": world.role, "node": world.env.node_name})
    job = importlib.import_module(JOBS[config.run.job])
    try:
        job.main(config, world, run_dir)
    except BaseException as exc:  # every failure of a rank must end the world, not leave peers waiting
        record_failure(run_dir, world, exc)
        world.comm.Abort(1)
        return 1
    return 0


if __name__ == "__main__":
    signals.install()
    sys.exit(run_rank(Path(sys.argv[1])))
