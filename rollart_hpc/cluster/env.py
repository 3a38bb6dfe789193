"""The one reader of the process environment: MPI launcher and SLURM variables.

Everything else receives a `ProcessEnv`; no other module reads OMPI_*, PMI_*, PMIX_* or SLURM_* variables,
nor the GPUs the launcher gave the process (CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS), nor this node's
network interfaces (`interface_address`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from rollart_hpc.config.schema import NetConfig
from rollart_hpc.contracts.errors import UsageError


@dataclass(frozen=True)
class ProcessEnv:
    """Where this process runs. Fields that the environment does not give are None."""

    launcher_rank: int | None
    launcher_size: int | None
    local_rank: int | None
    node_name: str
    slurm_job_id: str | None
    slurm_step_id: str | None
    slurm_restart_count: int
    slurm_het_group: int | None
    visible_gpus: tuple[str, ...] | None = None
    """GPU ids the process may use, in CUDA order (CUDA_VISIBLE_DEVICES, else SLURM_STEP_GPUS); None when
    neither is set (then every GPU of the machine is visible)."""

    @property
    def under_slurm(self) -> bool:
        return self.slurm_job_id is not None


def _first_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def _gpu_list(env: Mapping[str, str]) -> tuple[str, ...] | None:
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS"):
        value = env.get(name)
        if value is not None:
            return tuple(v.strip() for v in value.split(",") if v.strip())
    return None


def read_process_env(env: Mapping[str, str] | None = None) -> ProcessEnv:
    """Read rank/size/node/SLURM facts once from `env` (default: os.environ)."""
    env = os.environ if env is None else env
    return ProcessEnv(
        launcher_rank=_first_int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"),
        launcher_size=_first_int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"),
        local_rank=_first_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"),
        node_name=env.get("SLURMD_NODENAME") or socket.gethostname(),
        slurm_job_id=env.get("SLURM_JOB_ID") or None,
        slurm_step_id=env.get("SLURM_STEP_ID") or None,
        slurm_restart_count=_first_int(env, "SLURM_RESTART_COUNT") or 0,
        slurm_het_group=_first_int(env, "SLURM_HET_JOB_ID_SET_INDEX", "SLURM_HET_GROUP"),
        visible_gpus=_gpu_list(env),
    )


def store_host(net: NetConfig) -> str:
    """This node's address for the rendezvous stores it serves to other nodes: on the interface
    [cluster.net] names (gloo's, else NCCL's); '' when it names none."""
    key, name = net.store_interface()
    return interface_address(name, key) if name else ""


def interface_address(name: str, key: str) -> str:
    """This node's IPv4 address on network interface `name`; a UsageError naming the config `key` and the
    node's interfaces when it has no such interface (or no IPv4 address on it)."""
    import psutil

    interfaces = psutil.net_if_addrs()
    for addr in interfaces.get(name, []):
        if addr.family == socket.AF_INET:
            return str(addr.address)
    have = ", ".join(sorted(interfaces))
    raise UsageError(
        f"{key}: no network interface {name!r} with an IPv4 address on {socket.gethostname()} (it has {have})"
    )
