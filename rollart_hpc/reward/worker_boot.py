"""Imported only by the reward pool's forkserver (first in its preload list): the forkserver dies with
the process that started it (a reward rank or the reward service), even one killed with SIGKILL, so
nothing of a pool outlives its owner. The workers it forks set the same signal (`pool._worker_init`)
and so die with the forkserver."""

from __future__ import annotations

import os

from rollart_hpc.cluster.lifetime import set_parent_death_signal

_parent = os.getppid()
set_parent_death_signal()
if os.getppid() != _parent:  # the owner died before the signal was set
    os._exit(1)
