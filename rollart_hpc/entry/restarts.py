"""`--max-restarts N` for `launch.py run` and `resume`: automatic local recovery from a failed world.

When a world ends because a rank failed or died (not Ctrl-C, a launcher signal or the launch timeout),
the launcher starts the run again from its last complete checkpoint (the same path as `launch.py
resume`: inputs checked first, then a new world whose controller resumes), up to N times. Each restart
is appended to `run_dir/restarts.jsonl` (restart number, checkpoint step, cause, time; the file is
rewritten atomically). When a failure repeats with the same cause at the same checkpoint step, the run
cannot progress: the launcher stops with one line instead of spending the remaining restarts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_hpc.contracts.atomic import atomic_write_bytes
from rollart_hpc.contracts.errors import UsageError

if TYPE_CHECKING:
    from rollart_hpc.config.schema import Config

RESTARTS = "restarts.jsonl"


@dataclass(frozen=True)
class WorldOutcome:
    """How a world ended: the launcher's exit code and, when a rank failed or died, that named failure."""

    code: int
    cause: str | None  # e.g. "rank 2 (env) died without reporting an error"; None when no rank failed
    stopped_by_launcher: bool  # Ctrl-C, SIGTERM/SIGHUP or the launch timeout: not a rank's failure


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart a failed run from its last complete checkpoint up to N times (default 0)",
    )


def checked_count(value: int) -> int:
    if value < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {value}")
    return value


def check_resumable_run(run_dir: Path, config: Config) -> None:
    """Everything a resumed run reads, checked before any of it changes: the model it starts from, the
    newest checkpoint (same config, readable) and the trajectory store it truncates. UsageError otherwise.
    (Imports inside: the CLI imports this module to build its parser, and `--help` stays fast.)"""
    from rollart_hpc.controller.checkpoint import check_resumable, latest
    from rollart_hpc.models.validate import check_model_dir

    prepared = run_dir / "model" / "init"
    if (prepared / "config.json").exists():
        check_model_dir(prepared)
    elif config.model.source == "path":
        check_model_dir(config.model.path)
    checkpoint = latest(run_dir)
    if checkpoint is not None:
        check_resumable(run_dir, config, checkpoint)


def checkpoint_step(run_dir: Path) -> int:
    """Version of the newest complete checkpoint, 0 when there is none (the run restarts from the start)."""
    from rollart_hpc.controller.checkpoint import latest

    path = latest(run_dir)
    return int(path.name.split("-")[1]) if path is not None else 0


def read_restarts(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / RESTARTS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def record_restart(run_dir: Path, step: int, cause: str) -> dict[str, Any]:
    rows = read_restarts(run_dir)
    row = {"restart": len(rows) + 1, "step": step, "cause": cause, "time": time.time()}
    text = "".join(json.dumps(r) + "\n" for r in [*rows, row])
    atomic_write_bytes(run_dir / RESTARTS, text.encode())
    return row


def run_with_restarts(
    run_dir: Path,
    run_world: Callable[[], WorldOutcome],
    max_restarts: int,
    before_restart: Callable[[], None],
) -> int:
    """Run the world; after a rank's failure restart it (calling `before_restart` first) up to
    `max_restarts` times, unless the same failure repeats at the same checkpoint step."""
    outcome = run_world()
    previous: tuple[str, int] | None = None
    for restart in range(1, max_restarts + 1):
        if outcome.code == 0 or outcome.stopped_by_launcher or outcome.cause is None:
            break
        step = checkpoint_step(run_dir)
        if previous == (outcome.cause, step):
            print(
                f"error: not restarting: the same failure repeated at step {step}: {outcome.cause}",
                file=sys.stderr,
            )
            break
        previous = (outcome.cause, step)
        record_restart(run_dir, step, outcome.cause)
        print(f"restart {restart}/{max_restarts} from step {step} after: {outcome.cause}", flush=True)
        before_restart()
        outcome = run_world()
    else:
        if max_restarts and outcome.code != 0 and not outcome.stopped_by_launcher:
            print(
                f"error: giving up after {max_restarts} restarts (see {run_dir / RESTARTS})", file=sys.stderr
            )
    return outcome.code
