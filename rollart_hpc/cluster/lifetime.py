"""Nothing outlives its rank: the helper processes a rank starts die with it.

Megatron's distributed checkpoint save starts a spawn-context multiprocessing Manager (and fork-context
writer processes); killed with SIGKILL, a rank cannot stop them, and a survivor keeps the rank's output
pipe open so `mpiexec` never exits. Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`) makes the
kernel send SIGKILL to such a child when its parent dies:

- `bind_children()` runs first thing in a rank: every `os.fork()` child sets the signal right away, and
  the rank's pid is exported (`ROLLART_RANK_PID`) for children that start a fresh interpreter;
- `die_with_parent()` runs in a spawn child of a rank (the rank's main module is imported there as
  `__mp_main__`): it sets the signal, or exits at once if the rank is already gone.

The signal follows the thread that created the child, so a child created by a short-lived thread would
die with that thread; the rank's helpers are created from its main thread. The launcher is the second
line of defence: it kills each rank's process group at the end of the world (`cluster/supervise.py`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from rollart_hpc.cluster.procs import pid_alive

RANK_PID_VARIABLE = "ROLLART_RANK_PID"
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0


def die_with_parent() -> None:
    """In a spawn child of a rank: die with the parent, and exit now if the rank is already gone."""
    set_parent_death_signal()
    rank_pid = _exported_rank_pid()
    if rank_pid is not None and not pid_alive(rank_pid):
        os._exit(1)


def _exported_rank_pid() -> int | None:
    value = os.environ.get(RANK_PID_VARIABLE)
    return int(value) if value else None


_forker: list[int] = []  # pid of the process about to fork, read by its child


def _before_fork() -> None:
    _forker[:] = [os.getpid()]


def _after_fork_in_child() -> None:
    set_parent_death_signal()
    if _forker and os.getppid() != _forker[0]:  # the parent died before the signal was set
        os._exit(1)


def bind_children() -> None:
    """Make every process this rank forks or spawns from now on die with it (see the module docstring)."""
    os.environ[RANK_PID_VARIABLE] = str(os.getpid())
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
