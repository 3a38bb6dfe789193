"""`python -m rollart_hpc.cluster.srun_watch SRUN_PID [--grace-s S] [--run-dir D --ranks N]`: end an srun
that outlives its step.

Why: Slurm 22.05's srun sometimes never exits after its step has ended: every task is gone, slurmctld
no longer lists the step, and srun (with a forked child srun) sits on a futex for good. Seen both after a
forced termination ("Force Terminated StepId=...", a task killed under `--kill-on-bad-exit`) and after
a step whose tasks all exited 0. The job script then never reaches its restart or requeue logic and the
job runs into its time limit. The job scripts start this watcher beside each srun step.

How: every `--poll-s` it asks slurmctld for the job's steps (`squeue --steps`; the batch and extern
steps do not count). Once the step has been listed and then is no longer listed for `--grace-s`
seconds while srun is still alive, it SIGKILLs srun; the script's `wait` then returns 137. With
`--run-dir` and `--ranks` the watcher then exits `STEP_FINISHED` (3) when every rank of the world wrote
its exit record (code 0) during this step, and the job script counts the step as a success; otherwise it
exits 1 and the script handles the step like any failed one (and as success when the run has written its
finish marker). When squeue fails (slurmctld unreachable) nothing is decided. The watcher exits 0 when
srun exits by itself. Standard library only: it runs beside every step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rollart_hpc.cluster import slurm
from rollart_hpc.cluster.procs import pid_alive, ranks_finished

# Steps of a job that are not an srun step: the batch script itself and the extern/interactive steps.
NOT_SRUN_STEPS = ("batch", "extern", "interactive")
# The watcher's exit status when it killed srun after every rank had finished: the step succeeded.
STEP_FINISHED = 3

StepLister = Callable[[], list[str] | None]


def srun_steps(job_id: str, listed: list[str]) -> list[str]:
    """The srun steps of job `job_id` among squeue's step ids ("119.0"; a heterogeneous job's first
    component may also be written "119+0.0")."""
    own = []
    for step in listed:
        job, _, name = step.partition(".")
        if job in (job_id, f"{job_id}+0") and name and name not in NOT_SRUN_STEPS:
            own.append(step)
    return own


def squeue_steps(job_id: str) -> list[str] | None:
    """The job's srun steps slurmctld lists now; None when squeue fails."""
    listed = slurm.job_steps(job_id)
    return None if listed is None else srun_steps(job_id, listed)


def watch(pid: int, steps: StepLister, grace_s: float, poll_s: float = 5.0) -> bool:
    """Until `pid` exits: True once it was SIGKILLed for outliving its step by `grace_s`."""
    seen = False
    gone_since: float | None = None
    while pid_alive(pid):
        listed = steps()
        if listed:
            seen, gone_since = True, None
        elif listed is None or not seen:
            gone_since = None  # slurmctld did not answer, or the step has not started yet
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= grace_s:
            print(
                f"[slurm] srun (pid {pid}) still running {grace_s:g} s after its step ended: killing it "
                "(a known srun hang; the step's tasks are gone)",
                flush=True,
            )
            os.kill(pid, signal.SIGKILL)
            return True
        time.sleep(poll_s)
    return False


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollart_hpc.cluster.srun_watch")
    parser.add_argument("pid", type=int, help="the srun process of the step")
    parser.add_argument("--grace-s", type=float, default=60.0, help="seconds srun gets to exit (default 60)")
    parser.add_argument("--poll-s", type=float, default=5.0, help="seconds between squeue calls (default 5)")
    parser.add_argument("--run-dir", type=Path, help="the run directory whose ranks write pids/rank-<r>.exit")
    parser.add_argument("--ranks", type=int, default=0, help="the world size (with --run-dir)")
    args = parser.parse_args(argv)
    started = time.time()
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        parser.error("SLURM_JOB_ID is not set: run it inside a SLURM job")
    if args.grace_s <= 0 or args.poll_s <= 0:
        parser.error(f"--grace-s and --poll-s must be > 0, got {args.grace_s}, {args.poll_s}")
    if (args.run_dir is None) != (args.ranks <= 0):
        parser.error(f"--run-dir and --ranks (> 0) go together, got {args.run_dir}, {args.ranks}")
    if not watch(args.pid, lambda: squeue_steps(job_id), args.grace_s, args.poll_s):
        return 0
    if args.run_dir is not None and ranks_finished(args.run_dir, args.ranks, started):
        print(f"[slurm] all {args.ranks} ranks had finished before srun was killed", flush=True)
        return STEP_FINISHED
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
