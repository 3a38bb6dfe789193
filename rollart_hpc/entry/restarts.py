"""`--max-restarts N` for `launch.py run` and `resume`, and the SLURM jobs' restart check.

The restart policy (which failure restarts a run, `restarts.jsonl`, the stop on a repeated failure) is
`rollart_hpc/cluster/restarts.py`; this module binds it to the controller's checkpoints: whether a run
can resume (`check_resumable_run`) and the step of its newest complete checkpoint (`checkpoint_step`).

SLURM jobs (`cluster.max_restarts`) run `python -m rollart_hpc.entry.restarts RUN_DIR STATUS MAX
[--requeue]` after their srun step ended with STATUS != 0: exit 0 when the run is to start again (the
restart is recorded first), else 1, or 2 with one line on stderr for what it cannot act on (`--requeue`
outside a SLURM job, or a `scontrol requeue` that failed: the restart stays recorded, and a requeue by
hand takes its place). The sbatch script then starts a new step in its allocation; a submitit job
(`--requeue`) is requeued with `scontrol requeue`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_hpc.cluster import slurm
from rollart_hpc.cluster.env import read_process_env
from rollart_hpc.cluster.restarts import restart_after_failed_step
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout

if TYPE_CHECKING:
    from rollart_hpc.config.schema import Config


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart a failed run from its last complete checkpoint up to N times (default 0)",
    )


def check_resumable_run(run_dir: Path, config: Config) -> None:
    """Everything a resumed run reads, checked before any of it changes: the model it starts from, the
    newest checkpoint (same config, readable) and the trajectory store it truncates. UsageError otherwise.
    A complete checkpoint whose files are damaged is discarded with a line on stderr (the run falls back
    to an older one, or to the start). (Imports inside: the CLI imports this module to build its parser,
    and `--help` stays fast.)"""
    from rollart_hpc.controller.checkpoint import check_resumable, latest_valid
    from rollart_hpc.models.validate import check_model_dir

    prepared = RunLayout(run_dir).model / "init"
    if (prepared / "config.json").exists():
        check_model_dir(prepared)
    elif config.model.source == "path":
        check_model_dir(config.model.path)
    checkpoint = latest_valid(run_dir, lambda line: print(f"warning: {line}", file=sys.stderr, flush=True))
    if checkpoint is not None:
        check_resumable(run_dir, config, checkpoint)


def checkpoint_step(run_dir: Path) -> int:
    """Version of the newest complete checkpoint, 0 when there is none (the run restarts from the start)."""
    from rollart_hpc.controller.checkpoint import latest

    path = latest(run_dir)
    return int(path.name.split("-")[1]) if path is not None else 0


def job_script_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollart_hpc.entry.restarts")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("status", type=int, help="exit status of the srun step")
    parser.add_argument("max_restarts", type=int)
    parser.add_argument("--requeue", action="store_true", help="requeue the job instead (submitit)")
    args = parser.parse_args(argv)
    try:
        job_id = read_process_env().slurm_job_id if args.requeue else None
        if args.requeue and job_id is None:
            raise UsageError("--requeue outside a SLURM job")
        if args.status == 0 or not restart_after_failed_step(
            args.run_dir, args.status, args.max_restarts, check_resumable_run, checkpoint_step, job_id
        ):
            return 1
        if job_id is not None:
            slurm.requeue(job_id)  # same job id; it resumes from the run's last checkpoint
    except (UsageError, slurm.SchedulerError) as exc:  # one line in the job's log, and no restart
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(job_script_main(sys.argv[1:]))
