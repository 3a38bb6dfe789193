"""Per-step metrics of a run: `metrics.jsonl` (one JSON row per optimizer step, appended and flushed,
and one per evaluation round, marked `kind = "eval"` with `step` = the version it evaluated),
TensorBoard scalars under `tensorboard/`, a console progress line, and the end-of-run summary table.

Only the controller writes these; readers (`launch.py report`, people) may read them while the run goes on.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.path = run_dir / METRICS_FILE
        self._fh = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            # tensorboard's own event writer (what torch.utils.tensorboard wraps), without importing torch
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._tb = EventFileWriter(str(RunLayout(run_dir).tensorboard))

    def log(self, row: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps(row, sort_keys=True) + "\n")
        self._fh.flush()
        if self._tb is not None:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [
                Summary.Value(tag=key, simple_value=float(value))
                for key, value in row.items()
                if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"
            ]
            self._tb.add_event(
                Event(wall_time=time.time(), step=int(row["step"]), summary=Summary(value=values))
            )
            self._tb.flush()

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def is_eval_row(row: Mapping[str, Any]) -> bool:
    """A row written by an evaluation round (`kind = "eval"`, `step` = the version it evaluated), not by
    an optimizer step."""
    return row.get("kind") == "eval"


METRICS_FILE = RunLayout.METRICS_NAME


def read_rows(path: Path, *, skip_bad: bool = False) -> list[dict[str, Any]]:
    """The one reader of metrics.jsonl: its rows (JSON objects), [] when the file does not exist. A last line
    that does not parse (being written) is skipped; any other line that is not a JSON object is a one-line
    UsageError naming it. With `skip_bad` (reading many runs at once, or a run being written) every line that
    is not a JSON object is a warning on stderr and skipped."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif skip_bad:
            print(f"warning: {path}:{i + 1}: corrupt metrics line skipped", file=sys.stderr)
        elif i != last or row is not None:
            what = "not JSON" if row is None else "not a JSON object"
            raise UsageError(f"{path}: line {i + 1} is {what}")
    return rows


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run directory's metrics.jsonl (`read_rows`)."""
    return read_rows(run_dir / METRICS_FILE)


def truncate_metrics(run_dir: Path, version: int) -> list[dict[str, Any]]:
    """Keep the rows of steps before `version` (a resumed run continues there); returns them."""
    from rollart_hpc.contracts.atomic import atomic_write_bytes

    rows = [r for r in read_metrics(run_dir) if int(r["step"]) < version]
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    atomic_write_bytes(run_dir / METRICS_FILE, text.encode())
    return rows


def progress_line(row: Mapping[str, Any], num_steps: int) -> str:
    fams = " ".join(
        f"{k.split('/', 1)[1]}={row[k]:.2f}" for k in sorted(row) if k.startswith("train_success/")
    )
    return (
        f"step {row['step'] + 1}/{num_steps} v{row['version']} {row['wall_s']:.0f}s "
        f"success={row['train_success']:.2f} [{fams}] loss={row.get('loss', 0.0):+.4f} "
        f"stale={row.get('mean_staleness', 0.0):.2f} traj={row['trained_trajectories']}"
    )


def eval_line(row: Mapping[str, Any]) -> str:
    """One log line of an evaluation round's row: success per split (and family), episodes, seconds."""
    parts = []
    for key in sorted(k for k in row if k.endswith("_success") or "_success/" in k or "_success_" in k):
        parts.append(f"{key}={row[key]:.2f}")
    return (
        f"eval v{row['version']}: {' '.join(parts)} "
        f"({row['eval_episodes']} episodes, {row['eval_failed']} failed, {row['eval_s']:.0f}s)"
    )


def summary_table(summary: Mapping[str, Any], console: Console | None = None) -> str:
    """Render the end-of-run summary (success per family, the last evaluation round, trajectories by
    status, staleness, time split, failures and rebuilds per rollout and reward rank)."""
    console = console or Console(record=True, width=100, file=io.StringIO())  # rendered, not printed
    table = Table(title="run summary", show_header=True)
    table.add_column("what")
    table.add_column("value", justify="right")
    for family, value in sorted(summary.get("success_by_family", {}).items()):
        table.add_row(f"train success, {family} (first -> last step)", value)
    final_eval = summary.get("eval") or {}
    for key, value in sorted(final_eval.items()):
        if "_success" in key:
            table.add_row(f"{key} (version {final_eval['version']})", f"{value:.2f}")
    for status, count in summary.get("trajectories", {}).items():
        table.add_row(f"trajectories {status}", str(count))
    for lag, count in summary.get("staleness", {}).items():
        table.add_row(f"trained with staleness {lag}", str(count))
    for role, seconds in summary.get("time_split_s", {}).items():
        table.add_row(f"busy time, {role}", f"{seconds:.1f}s")
    for rank, counts in summary.get("failures_and_rebuilds", {}).items():
        table.add_row(f"failures / rebuilds, {rank}", f"{counts['failures']} / {counts['rebuilds']}")
    console.print(table)
    return console.export_text()
