"""Start a reward service on demand: the HPC form of scale to zero.

`launch.py reward-service --slurm` writes `launch.json` into the service dir (the command that submits the
service's job again) and submits the job; the service exits after `--idle-exit-s` with nothing to do,
which releases its allocation, and removes its address file. A client that then finds no live service
calls `ensure_started`, which resubmits the job.

Files in the service dir: `launch.json` (argv and cwd of the submission), `job.json` (the job submitted
last: id, submission time, who submitted it; written atomically), `start.lock` (flock'ed while one
process decides and submits) and `starts.jsonl` (one line per start that came up: submitted, up,
startup_s, job id, by), appended by the service itself once its address file is written.
Who waits on whom: a client never blocks on the lock (LOCK_NB: another process is deciding, so this one
only waits for the address file, as it would anyway); the holder runs squeue and sbatch.
Invariant: at most one job of the service is pending or running at a time, however many clients find it
gone at once: a job is submitted only under the lock, and only when the job recorded in `job.json` is no
longer pending or running. Nothing here imports zmq; SLURM is reached only through the commands.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rollart_hpc.cluster import slurm
from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.reward.wire import ADDRESS_FILE

LAUNCH_FILE = "launch.json"
JOB_FILE = "job.json"
LOCK_FILE = "start.lock"
STARTS_FILE = "starts.jsonl"
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED"})
COMMAND_TIMEOUT_S = 60.0

JobState = Callable[[str], str | None]


def write_launch(service_dir: Path, argv: Sequence[str], cwd: Path) -> None:
    """Record how to submit the service again (what `ensure_started` runs)."""
    atomic_write_json(service_dir / LAUNCH_FILE, {"argv": list(argv), "cwd": str(cwd)})


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def can_start(service_dir: Path) -> bool:
    return (service_dir / LAUNCH_FILE).exists()


def squeue_state(job_id: str) -> str | None:
    """The job's state while squeue lists it, None once it left the queue (`cluster.slurm.job_state`)."""
    return slurm.job_state(job_id)


def submit(service_dir: Path, by: str) -> str:
    """Run the recorded submission; record and return the new job id."""
    launch = read_json(service_dir / LAUNCH_FILE)
    if launch is None:
        raise FileNotFoundError(f"no {LAUNCH_FILE} in {service_dir}: the service cannot be started on demand")
    submitted = time.time()
    proc = subprocess.run(
        launch["argv"],
        cwd=launch["cwd"],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(launch['argv'])} failed: {proc.stderr.strip()}")
    job_id = proc.stdout.strip().split(";")[0]  # sbatch --parsable: "id" or "id;cluster"
    atomic_write_json(service_dir / JOB_FILE, {"job_id": job_id, "submitted": submitted, "by": by})
    return job_id


def live_job(service_dir: Path, job_state: JobState) -> str | None:
    """The recorded job's id while it is pending or running, else None."""
    job = read_json(service_dir / JOB_FILE)
    if job is None:
        return None
    state = job_state(str(job["job_id"]))
    return str(job["job_id"]) if state is not None and state.split()[0] in LIVE_STATES else None


def ensure_started(service_dir: Path, by: str, job_state: JobState | None = None) -> str | None:
    """Submit the service's job unless one is pending or running; the new job id, or None when nothing
    was submitted (a job is live, or another process holds the lock and decides)."""
    service_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(service_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        if live_job(service_dir, job_state or squeue_state) is not None:
            return None
        (service_dir / ADDRESS_FILE).unlink(missing_ok=True)  # its job is gone: a stale address
        return submit(service_dir, by)
    finally:
        os.close(fd)  # releases the lock


def record_start(service_dir: Path, job_id: str | None, up: float) -> dict[str, Any] | None:
    """Called by the service once its address file is written: append its start-up time (submission to
    address file) to `starts.jsonl` when this job is the one `job.json` recorded."""
    job = read_json(service_dir / JOB_FILE)
    if job is None or job_id is None or str(job.get("job_id")) != job_id:
        return None
    row = {
        "job_id": job_id,
        "by": job.get("by", "?"),
        "submitted": job["submitted"],
        "up": up,
        "startup_s": round(up - float(job["submitted"]), 3),
    }
    with (service_dir / STARTS_FILE).open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row
