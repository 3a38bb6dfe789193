"""`launch.py submit CONFIG [overrides] [--run-dir DIR] [--dry-run]`: run a config as one SLURM job.

The config is resolved exactly as for `run` and written to the run dir. Roles map to partitions by
`roles.<role>.partition`:
- one partition (or none set): one job through submitit; every srun task executes `rollart_hpc.entry.worker`
  for the run dir (in submitit's task process), with `slurm/mpi_env.sh` sourced in the job's setup.
- several partitions: a heterogeneous job rendered from `slurm/templates/hetjob.sbatch.in` (see
  `rollart_hpc.cluster.sbatch`), submitted with `sbatch`; one `srun --het-group` step is the MPI world.
After submission `run_dir/slurm_job.json` (written atomically) records the job id, mode and log paths.
`--dry-run` prints the job and, as `#` comment lines, every rank's predicted node and device
(`cluster.placement`); with `--out FILE` it writes the script (for a single partition too: one component,
no submitit) and prepares the run dir instead, for `sbatch FILE`. A job that asks a partition for more GPUs
per node than its nodes have is refused before sbatch, in one line. So is a run whose memory plan
(`rollart_hpc.plan.ranks`) does not fit some rank's GPU; a dry run prints that plan after the job.

Stops and requeues (both modes): a stop signal (SIGUSR1/SIGUSR2: `--signal`, preemption notice,
`scancel --signal=USR2 JOB`) makes the controller checkpoint and stop the whole world with exit 0 and no
finish marker (`summary.json` for RL runs). Only then is the job requeued, by `scontrol requeue` once
the step has ended (never while it runs, which would kill it before the checkpoint is written), while
SLURM_RESTART_COUNT < --max-requeues. The hetjob script does this itself (see the template). Under
submitit the signal handlers of submitit's task process are replaced by the run's own once the RL job
starts (every rank ignores the stop signals, the controller checkpoints), so submitit's
checkpoint-and-requeue never runs then; `WorkerTask` requeues instead: on the task of global rank 0,
after the world stopped at a checkpoint, it calls `scontrol requeue` and ends without a result (the
job's result is the finished run's), or raises when no requeue is left. A signal that arrives while
submitit's own handler is still installed (before the run's handlers) is handled by submitit: it
requeues a preempted job at once, and the run resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_hpc.cluster import slurm
from rollart_hpc.cluster.jobs import (
    JOB_RECORD,
    job_record,
    job_spec,
    prepare_run_dir,
    require_slurm,
    sbatch,
)
from rollart_hpc.contracts.errors import UsageError

if TYPE_CHECKING:
    from rollart_hpc.cluster.plan import RunPlan
    from rollart_hpc.cluster.sbatch import HetComponent, JobSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. roles.trainer.partition=train")
    parser.add_argument("--run-dir", help="run directory (default: runs/<run.name>-<timestamp>)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the sbatch script (or submitit parameters) and every rank's node and device",
    )
    parser.add_argument(
        "--out",
        help="with --dry-run: write the job script to this file and the resolved config to the run dir, "
        "so that `sbatch FILE` runs it as is",
    )
    parser.add_argument("--time-min", type=int, default=60, help="job time limit in minutes (default 60)")
    parser.add_argument(
        "--max-requeues",
        type=int,
        default=3,
        help="requeues after the run stopped at a checkpoint (preemption, time limit, USR2; default 3)",
    )
    parser.add_argument(
        "--nodes", type=int, default=1, help="nodes of a single-partition job; ranks split evenly (default 1)"
    )


@dataclass(frozen=True)
class WorkerTask:
    """What each submitit task runs: this rank's `rollart_hpc.entry.worker` for the run dir (picklable).

    `finish_marker` is the file a finished run leaves (None: exit 0 is the end); `max_requeues` bounds the
    requeues after stops at a checkpoint (see the module docstring)."""

    run_dir: str
    finish_marker: str | None = None
    max_requeues: int = 0

    def __call__(self) -> int:
        from rollart_hpc.entry.worker import run_rank

        code = run_rank(Path(self.run_dir))
        if code != 0:
            raise RuntimeError(f"rollart_hpc.entry.worker exited with code {code} for run dir {self.run_dir}")
        if self.finish_marker is not None and not (Path(self.run_dir) / self.finish_marker).exists():
            requeue_after_stop(Path(self.run_dir), self.max_requeues)
        return code


def requeue_after_stop(run_dir: Path, max_requeues: int) -> None:
    """The world stopped at a checkpoint: the task of global rank 0 requeues the job and exits without a
    result (SystemExit); the other tasks return. With no requeue left, rank 0 raises RuntimeError."""
    from rollart_hpc.cluster.env import read_process_env

    env = read_process_env()
    if env.launcher_rank != 0:
        return
    if env.slurm_job_id is None:
        raise RuntimeError(f"the run in {run_dir} stopped at a checkpoint outside SLURM: nothing to requeue")
    restarts = env.slurm_restart_count
    if restarts >= max_requeues:
        raise RuntimeError(
            f"the run in {run_dir} stopped at a checkpoint, and {restarts} of {max_requeues} requeues are "
            f"used: not requeued; continue it with 'scontrol requeue {env.slurm_job_id}'"
        )
    print(
        f"[slurm] the run stopped at a checkpoint: requeue job {env.slurm_job_id} "
        f"(restart {restarts + 1} of {max_requeues})",
        flush=True,
    )
    slurm.requeue(env.slurm_job_id)
    raise SystemExit(0)


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.cluster.sbatch import check_run_dir, plan_partitions
    from rollart_hpc.config import load_config
    from rollart_hpc.plan.ranks import memory_plan_text

    config = load_config(args.config, args.overrides)
    plan = make_plan(config.roles)
    check_options(args)
    check_own_code(config)
    run_dir = Path(args.run_dir or f"runs/{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    check_run_dir(run_dir)
    spec = job_spec(config, run_dir, args.time_min, args.max_requeues)
    _, refusal = memory_plan_text(config)
    if refusal and (not args.dry_run or args.out):
        raise UsageError(refusal)
    if len(plan_partitions(plan)) > 1 or len(plan.pools()) > 1:  # each rollout pool: a component
        if args.nodes != 1:
            raise UsageError(
                "--nodes applies to single-partition jobs; hetjob components get nodes from SLURM"
            )
        code = submit_hetjob(spec, plan, config, args.dry_run, args.out)
    else:
        code = submit_single(spec, plan, config, args.nodes, args.dry_run, args.out)
    if refusal:  # a dry run has shown the job and its memory plan
        raise UsageError(refusal)
    return code


def check_options(args: argparse.Namespace) -> None:
    if args.time_min < 1:
        raise UsageError(f"--time-min must be >= 1, got {args.time_min}")
    if args.max_requeues < 0:
        raise UsageError(f"--max-requeues must be >= 0, got {args.max_requeues}")
    if args.out and not args.dry_run:
        raise UsageError("--out writes the job script instead of submitting it: add --dry-run")


def check_own_code(config: Any) -> None:
    """The run's own families, reward functions and task files, checked before anything is submitted."""
    from rollart_hpc.tasks.checks import check_own_code as check

    for line in check(config.envs, config.reward, config.run.python_path):
        print(line, flush=True)


def submit_hetjob(spec: JobSpec, plan: RunPlan, config: Any, dry_run: bool, out: str | None = None) -> int:
    from rollart_hpc.cluster.sbatch import (
        HETJOB_SCRIPT,
        check_components_fit,
        check_gpus_fit,
        het_components,
        render_hetjob,
    )
    from rollart_hpc.contracts.atomic import atomic_write_bytes

    components = het_components(plan)
    script = render_hetjob(spec, components)
    if dry_run:
        return show_dry_run(spec, plan, config, components, script, out)
    require_slurm()
    check_components_fit(components, slurm.partition_nodes())
    check_gpus_fit(components, slurm.partition_gpus())
    prepare_run_dir(config, spec.run_dir)
    script_path = spec.run_dir / HETJOB_SCRIPT
    atomic_write_bytes(script_path, script.encode())
    job_id = sbatch(script_path)
    log = str(spec.hetjob_output).replace("%j", job_id)
    record = job_record(spec, plan, "hetjob", job_id, [log])
    record["script"] = str(script_path)
    record["components"] = [
        {"partition": c.partition, "ranks": [c.start, c.start + c.num_ranks], "roles": list(c.roles)}
        for c in components
    ]
    return finish(spec, record)


def show_dry_run(
    spec: JobSpec,
    plan: RunPlan,
    config: Any,
    components: tuple[HetComponent, ...],
    script: str | None,
    out: str | None,
) -> int:
    """Print (or with `out`, write and prepare the run dir for) the job with every rank's placement, then
    the memory plan."""
    from rollart_hpc.cluster.sbatch import render_job
    from rollart_hpc.contracts.atomic import atomic_write_bytes
    from rollart_hpc.plan.ranks import memory_plan_text

    memory = "".join(f"# {line}\n" for line in memory_plan_text(config)[0].splitlines())
    if out is None:
        print(job_text(plan, components, script or "") + memory, end="")
        return 0
    text = job_text(plan, components, script or render_job(spec, components))
    atomic_write_bytes(Path(out), text.encode())
    prepare_run_dir(config, spec.run_dir)
    print(text[text.index("# placement") :] + memory, end="")
    print(f"# wrote {Path(out).resolve()}; run dir {spec.run_dir} holds the resolved config")
    print(f"# submit it as is: sbatch {shlex.quote(str(Path(out).resolve()))}")
    return 0


def job_text(plan: RunPlan, components: tuple[HetComponent, ...], script: str) -> str:
    """The job script followed by every rank's predicted placement as comment lines (what dry runs show)."""
    from rollart_hpc.cluster.placement import check_distinct, placement_table, predict
    from rollart_hpc.cluster.sbatch import component_layout

    placements = predict(plan, component_layout(components), ())
    check_distinct(placements)
    return script + "".join(f"# {line}\n" for line in placement_table(placements).splitlines())


def submit_single(
    spec: JobSpec, plan: RunPlan, config: Any, nodes: int, dry_run: bool, out: str | None = None
) -> int:
    from rollart_hpc.cluster.sbatch import (
        check_gpus_fit,
        check_single_fit,
        single_component,
        submitit_parameters,
    )

    params = submitit_parameters(spec, plan, nodes)
    component = single_component(plan, nodes)
    if dry_run:
        show_dry_run(spec, plan, config, (component,), None, out)
        if out is None:
            print(
                f"submitit SlurmExecutor(folder={str(spec.submitit_folder)!r}, max_num_timeout={spec.max_requeues})"
            )
            print(json.dumps(params, indent=1, sort_keys=True))
        return 0
    require_slurm()
    check_single_fit(params.get("partition", ""), nodes, slurm.partition_nodes())
    check_gpus_fit((component,), slurm.partition_gpus())
    prepare_run_dir(config, spec.run_dir)
    job_id, logs = submitit_submit(spec, params)
    record = job_record(spec, plan, "submitit", job_id, logs)
    record["submitit_parameters"] = params
    return finish(spec, record)


def submitit_submit(spec: JobSpec, params: dict[str, Any]) -> tuple[str, list[str]]:
    import submitit

    executor = submitit.SlurmExecutor(folder=spec.submitit_folder, max_num_timeout=spec.max_requeues)
    executor.update_parameters(**params)
    job = executor.submit(WorkerTask(str(spec.run_dir), spec.finish_marker, spec.max_requeues))
    return str(job.job_id), [str(job.paths.stdout), str(job.paths.stderr)]


def finish(spec: JobSpec, record: dict[str, Any]) -> int:
    from rollart_hpc.contracts.atomic import atomic_write_json

    atomic_write_json(spec.run_dir / JOB_RECORD, record)
    print(f"submitted job {record['job_id']} ({record['mode']}, {record['world_size']} ranks)")
    print(f"run dir {spec.run_dir}")
    for log in record["logs"]:
        print(f"log {log}")
    print(f"rank logs {spec.run_dir / 'logs'}/rank-<r>.log", file=sys.stdout, flush=True)
    return 0
