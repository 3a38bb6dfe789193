"""The restart policy: automatic recovery of a failed run from its last complete checkpoint.

When a world ends because a rank failed or died (not Ctrl-C, a launcher signal or the launch timeout),
the run starts again from its last complete checkpoint (the same path as `launch.py resume`: inputs
checked first, then a new world whose controller resumes), up to N times (`--max-restarts N`, see
`rollart_hpc/entry/restarts.py`). Each restart is appended to `run_dir/restarts.jsonl` (restart number,
checkpoint step, cause, time; the file is rewritten atomically). When a failure repeats with the same
cause at the same checkpoint step, the run cannot progress: the policy stops with one line instead of
spending the remaining restarts. Deaths without a word count as one cause whichever rank is named
(`failure_kind`): a SIGKILL, an OOM kill or a lost node takes peers down within milliseconds, and which of
them the launcher saw first is chance.

SLURM jobs (`cluster.max_restarts`) use the same rules (`restart_after_failed_step`) after their srun
step ended with a non-zero status. There the count of restarts is the rows of `restarts.jsonl` (it
outlives a requeue), and the repeated failure is the last row's cause at the same checkpoint step.

The checkpoints themselves belong to the controller: the caller passes the check that a run can resume
(`check_resumable`, which discards damaged checkpoints) and the step of its newest complete checkpoint
(`checkpoint_step`).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_hpc.contracts.atomic import atomic_write_bytes
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout, read_restarts

if TYPE_CHECKING:
    from rollart_hpc.config.schema import Config

RESTARTS = RunLayout.RESTARTS_NAME


@dataclass(frozen=True)
class WorldOutcome:
    """How a world ended: the launcher's exit code and, when a rank failed or died, that named failure."""

    code: int
    cause: str | None  # e.g. "rank 2 (env) died without reporting an error"; None when no rank failed
    stopped_by_launcher: bool  # Ctrl-C, SIGTERM/SIGHUP or the launch timeout: not a rank's failure


def checked_count(value: int) -> int:
    if value < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {value}")
    return value


def record_restart(run_dir: Path, step: int, cause: str, requeued_job: str | None = None) -> dict[str, Any]:
    """Append a restart row; `requeued_job` names the SLURM job when the restart is a requeue of it."""
    rows = read_restarts(run_dir)
    row: dict[str, Any] = {"restart": len(rows) + 1, "step": step, "cause": cause, "time": time.time()}
    if requeued_job is not None:
        row["requeued_job"] = requeued_job
    text = "".join(json.dumps(r) + "\n" for r in [*rows, row])
    atomic_write_bytes(run_dir / RESTARTS, text.encode())
    return row


SILENT_DEATH = "died without reporting an error"


def failure_kind(cause: str) -> str:
    """What makes two failures 'the same': a reported error with its rank and the first line of its
    message (later lines may carry timestamps and addresses, e.g. HDF5's error stack); for a death
    without a word only that (which rank of a world torn down at once is named first is timing)."""
    return SILENT_DEATH if cause.endswith(SILENT_DEATH) else cause.strip().split("\n", 1)[0]


def run_with_restarts(
    run_dir: Path,
    run_world: Callable[[], WorldOutcome],
    max_restarts: int,
    before_restart: Callable[[], None],
    checkpoint_step: Callable[[Path], int],
) -> int:
    """Run the world; after a rank's failure restart it (calling `before_restart` first) up to
    `max_restarts` times, unless the same failure repeats at the same checkpoint step."""
    outcome = run_world()
    previous: tuple[str, int] | None = None
    for restart in range(1, max_restarts + 1):
        if outcome.code == 0 or outcome.stopped_by_launcher or outcome.cause is None:
            break
        before_restart()  # first: it discards a damaged newest checkpoint, which changes `step`
        step = checkpoint_step(run_dir)
        if previous == (failure_kind(outcome.cause), step):
            print(
                f"error: not restarting: the same failure repeated at step {step}: {outcome.cause}",
                file=sys.stderr,
            )
            break
        previous = (failure_kind(outcome.cause), step)
        record_restart(run_dir, step, outcome.cause)
        print(f"restart {restart}/{max_restarts} from step {step} after: {outcome.cause}", flush=True)
        outcome = run_world()
    else:
        if max_restarts and outcome.code != 0 and not outcome.stopped_by_launcher:
            print(
                f"error: giving up after {max_restarts} restarts (see {run_dir / RESTARTS})", file=sys.stderr
            )
    return outcome.code


def step_failure_cause(run_dir: Path, status: int) -> str:
    """The first failure a rank reported (failures/), else the srun step's exit status."""
    reports = [json.loads(p.read_text()) for p in RunLayout(run_dir).failures.glob("rank-*.json")]
    if reports:
        first = min(reports, key=lambda f: f["time"])
        return f"rank {first['rank']} ({first['role']}) failed: {first['message']}"
    return f"the srun step exited with status {status} (a rank was killed or crashed)"


def restart_after_failed_step(
    run_dir: Path,
    status: int,
    max_restarts: int,
    check_resumable: Callable[[Path, Config], None],
    checkpoint_step: Callable[[Path], int],
    requeued_job: str | None = None,
) -> bool:
    """A SLURM job's step ended with `status` != 0: True (the restart recorded) when the run should start
    again from its last checkpoint: not finished, restarts left, its inputs check out (damaged checkpoints
    are discarded) and not the same failure as the last restart at the same checkpoint step.
    `requeued_job`: the job that the caller requeues for the restart (submitit), recorded in the row."""
    from rollart_hpc.config import read_resolved

    rows = read_restarts(run_dir)
    cause = step_failure_cause(run_dir, status)
    if RunLayout(run_dir).summary.exists() or len(rows) >= max_restarts:
        print(f"[slurm] not restarting: {len(rows)} of {max_restarts} restarts used ({cause})", flush=True)
        return False
    try:
        check_resumable(run_dir, read_resolved(run_dir))
    except UsageError as exc:
        print(f"[slurm] not restarting: {exc}", flush=True)
        return False
    step = checkpoint_step(run_dir)
    if rows and (failure_kind(rows[-1]["cause"]), rows[-1]["step"]) == (failure_kind(cause), step):
        print(f"[slurm] not restarting: the same failure repeated at step {step}: {cause}", flush=True)
        return False
    row = record_restart(run_dir, step, cause, requeued_job)
    if RunLayout(run_dir).failures.exists():
        shutil.rmtree(RunLayout(run_dir).failures)  # this attempt's reports are not the next one's
    print(f"[slurm] restart {row['restart']}/{max_restarts} from step {step} after: {cause}", flush=True)
    return True


def failure_requeues(run_dir: Path, job_id: str) -> int:
    """How many of job `job_id`'s requeues were restarts after a failure (a submitit job's): SLURM counts
    them in SLURM_RESTART_COUNT beside the requeues after a stop at a checkpoint."""
    return sum(1 for row in read_restarts(run_dir) if row.get("requeued_job") == job_id)
