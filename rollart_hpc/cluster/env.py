"""The one reader of the process environment: MPI launcher and SLURM variables.

Everything else receives a `ProcessEnv`; no other module reads OMPI_*, PMI_*, PMIX_* or SLURM_* variables,
nor the GPUs the launcher gave the process (CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass


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
