"""Other processes, seen by pid (standard library only: the srun watcher imports it beside every step)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rollart_hpc.contracts.rundir import RunLayout


def pid_alive(pid: int) -> bool:
    """Running: it exists (signal 0) and is not a zombie (an exited process its parent has not reaped
    yet counts as gone). A process of another user counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:  # the launcher asks this many times a second
            stat = stat_file.read()
    except OSError:
        return True  # no procfs: signal 0 is all there is
    state = stat.rfind(b")") + 2
    return stat[state : state + 1] != b"Z"


def children(pid: int) -> list[int]:
    """The direct children of a process (none when it is gone)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(found))


def rank_exit_path(run_dir: Path, rank: int) -> Path:
    """Written by a rank whose main returned normally: the launcher tells a finished rank from a silent
    death, and the srun watcher a step whose every rank finished from one it had to end."""
    return RunLayout(run_dir).exit_file(rank)


def ranks_finished(run_dir: Path, ranks: int, since: float) -> bool:
    """Every rank 0..ranks-1 wrote its exit record with code 0 at or after `since` (a Unix time: records
    of an earlier step of the same run do not count)."""
    for rank in range(ranks):
        try:
            record = json.loads(rank_exit_path(run_dir, rank).read_text())
        except (OSError, ValueError):
            return False
        if not isinstance(record, dict) or record.get("code") != 0 or float(record.get("time", 0)) < since:
            return False
    return True
