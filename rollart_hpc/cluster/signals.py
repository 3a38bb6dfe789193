"""Stop requests by signal: SIGUSR1/SIGUSR2 (SLURM's --signal, a preemption notice, `scancel --signal`),
and SIGTERM when `cluster.sigterm_grace_s` > 0.

`install()` runs first thing in every rank, before the heavy imports, so a signal that arrives during
start-up is recorded instead of killing the rank (the default action). Only the controller acts on
`STOP_REQUESTED` (checkpoint, then exit for requeue); the other ranks follow its shutdown.
`install_sigterm(grace_s)` (once the config is read) makes SIGTERM a stop request too, with a deadline:
`past_grace()` is true once `grace_s` seconds have passed since the first SIGTERM, and the controller then
gives up on its checkpoint. With grace 0 SIGTERM's handler is not touched (the default: the rank ends).
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

STOP_REQUESTED = threading.Event()
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
_sigterm = {"grace_s": 0.0, "at": -1.0}  # the grace, and monotonic time of the first SIGTERM (-1: none)


def install() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: STOP_REQUESTED.set())


def install_sigterm(grace_s: float) -> None:
    """SIGTERM becomes a stop request with a deadline `grace_s` away (grace 0: its handler is left as is)."""
    _sigterm.update(grace_s=grace_s, at=-1.0)
    if grace_s > 0:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _sigterm["at"] < 0:
        _sigterm["at"] = time.monotonic()
    STOP_REQUESTED.set()


def past_grace(now: float | None = None) -> bool:
    """A SIGTERM came and its grace is over."""
    at = _sigterm["at"]
    return at >= 0 and (time.monotonic() if now is None else now) - at > _sigterm["grace_s"]
