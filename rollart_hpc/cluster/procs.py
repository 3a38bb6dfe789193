"""Other processes, seen by pid (standard library only: the srun watcher imports it beside every step)."""

from __future__ import annotations

import os
from pathlib import Path


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
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: signal 0 is all there is
    return stat[stat.rfind(")") + 2 :][:1] != "Z"


def children(pid: int) -> list[int]:
    """The direct children of a process (none when it is gone)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(found))
