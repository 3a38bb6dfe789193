"""Stop requests by signal: SIGUSR1/SIGUSR2 (SLURM's --signal, a preemption notice, `scancel --signal`).

`install()` runs first thing in every rank, before the heavy imports, so a signal that arrives during
start-up is recorded instead of killing the rank (the default action). Only the controller acts on
`STOP_REQUESTED` (checkpoint, then exit for requeue); the other ranks follow its shutdown.
"""

from __future__ import annotations

import signal
import threading

STOP_REQUESTED = threading.Event()
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def install() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: STOP_REQUESTED.set())
