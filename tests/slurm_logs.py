"""Reading a SLURM job from the slurm-marked tests: its clients' answers, the nodes its ranks ran on,
and what a job script's log says about its srun step.

A step succeeded when srun exited 0, or when srun hung after the step (a known Slurm 22.05 bug) and
`srun_watch` killed it after every rank had written its exit record: the job script then counts the step
as a success (slurm/templates/hetjob.sbatch.in)."""

import json
import subprocess
import time
from pathlib import Path

SRUN_EXITED_0 = "[slurm] step exited with status 0"
HUNG_SRUN_FINISHED = "[slurm] every rank had finished before srun hung: the step counts as a success"


def job_log(path: Path) -> str:
    """A job's output file. The ranks of a step share it and srun forwards their output in chunks, not
    lines, so one rank's bytes can land inside another's multi-byte character (the summary table's box
    drawing): such bytes read as U+FFFD rather than failing the read."""
    return path.read_text(errors="replace")


def step_succeeded(log: str) -> bool:
    return SRUN_EXITED_0 in log or HUNG_SRUN_FINISHED in log


def query(argv: list[str]) -> str:
    """stdout of a SLURM client; retried, since a loaded slurmctld sometimes drops a connection."""
    for _ in range(5):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if proc.returncode == 0:
            return proc.stdout
        time.sleep(2.0)
    raise AssertionError(f"{' '.join(argv)} failed 5 times: {proc.stderr.strip()}")


UNSETTLED = ("RUNNING", "PENDING", "COMPLETING", "REQUEUED")


def settled_states(job_id: str, timeout_s: float = 90.0) -> list[str]:
    """sacct's states of a job's components (or tasks) once none is still live.

    Accounting lags the queue: a job gone from squeue can still read RUNNING in sacct until slurmdbd
    has taken its end record, so this waits for the record rather than reading it once."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = query(["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id]).split()
        if states and not any(s in UNSETTLED for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def rank_nodes(run_dir: Path) -> dict[int, str]:
    pids = sorted((run_dir / "pids").glob("rank-*.pid"))
    return {int(p.stem.split("-")[1]): json.loads(p.read_text())["node"] for p in pids}
