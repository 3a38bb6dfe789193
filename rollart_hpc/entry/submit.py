"""`launch.py submit CONFIG [overrides] [--run-dir DIR] [--dry-run]`: run a config as one SLURM job.

The config is resolved exactly as for `run` and written to the run dir; the job (a heterogeneous job when
the roles sit on several partitions, else one submitit job whose every srun task runs `WorkerTask`:
`rollart_hpc.entry.worker` for the run dir) is submitted by `rollart_hpc/cluster/submission.py`.
`--dry-run` prints the job and every rank's predicted node and device; with `--out FILE` it writes the
script and prepares the run dir instead, for `sbatch FILE`.

Stops and requeues (both modes): a stop signal (SIGUSR1/SIGUSR2: `--signal`, preemption notice,
`scancel --signal=USR2 JOB`) makes the controller checkpoint and stop the whole world with exit 0 and no
finish marker (`summary.json` for RL runs). Only then is the job requeued, by `scontrol requeue` once
the step has ended (never while it runs, which would kill it before the checkpoint is written), while
fewer than --max-requeues such requeues are done (SLURM_RESTART_COUNT, less a submitit job's requeues after
a failure, which `cluster.max_restarts` bounds). The hetjob script does this itself (see the template). Under
submitit the signal handlers of submitit's task process are replaced by the run's own once the RL job
starts (every rank ignores the stop signals, the controller checkpoints), so submitit's
checkpoint-and-requeue never runs then; `WorkerTask` requeues instead: on the task of global rank 0,
after the world stopped at a checkpoint, it calls `scontrol requeue` (`requeue_after_stop`) and ends
without a result (the job's result is the finished run's), or raises when no requeue is left. A signal
that arrives while submitit's own handler is still installed (before the run's handlers) is handled by
submitit: it requeues a preempted job at once, and the run resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from rollart_hpc.cluster.jobs import job_spec
from rollart_hpc.cluster.submission import JobRequest, check_own_code, requeue_after_stop, submit_job
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry.options import add_config_arguments, add_run_dir_argument, resolve_run_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "dotted overrides, e.g. roles.trainer.partition=train")
    add_run_dir_argument(parser)
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
        help="requeues after the run stopped at a checkpoint (preemption, time limit, USR2; default 3); "
        "restarts after a failure are bounded by cluster.max_restarts instead",
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


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.cluster.sbatch import check_run_dir
    from rollart_hpc.config import load_config
    from rollart_hpc.plan.ranks import memory_plan_text

    config = load_config(args.config, args.overrides)
    plan = make_plan(config.roles)
    check_options(args)
    check_own_code(config)
    run_dir = resolve_run_dir(args, config.run.name)
    check_run_dir(run_dir)
    spec = job_spec(config, run_dir, args.time_min, args.max_requeues)
    task = WorkerTask(str(spec.run_dir), spec.finish_marker, spec.max_requeues)
    memory = memory_plan_text(config)
    return submit_job(JobRequest(spec, plan, config, args.nodes, args.dry_run, args.out, task, memory))


def check_options(args: argparse.Namespace) -> None:
    if args.time_min < 1:
        raise UsageError(f"--time-min must be >= 1, got {args.time_min}")
    if args.max_requeues < 0:
        raise UsageError(f"--max-requeues must be >= 0, got {args.max_requeues}")
    if args.out and not args.dry_run:
        raise UsageError("--out writes the job script instead of submitting it: add --dry-run")
