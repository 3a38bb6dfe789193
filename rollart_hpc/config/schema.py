"""The config schema: one typed tree, documented field by field. Torch-free.

Users state intent (how many ranks each role has, the staleness bound, ...); derived values are computed
once in `rollart_hpc.config.resolve` and written to the run directory. Sections that do not apply to
the selected `run.job` must be left at their defaults: an option with no effect is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollart_hpc.config.loader import doc_field
from rollart_hpc.errors import UsageError

ROLE_NAMES = ("controller", "rollout", "env", "reward", "trainer")
Job = Literal["smoke"]


@dataclass(frozen=True)
class RunConfig:
    name: str = doc_field("run", "Run name, used in logs and SLURM job names.")
    job: Job = doc_field("smoke", "What the world does: 'smoke' exchanges messages between every role pair.")
    seed: int = doc_field(0, "Global seed; every rank derives its own from it.")

    def validate(self, path: str) -> None:
        if not self.name or any(c in self.name for c in "/\\\n"):
            raise UsageError(f"{path}.name: {self.name!r} must be non-empty with no slashes or newlines")


@dataclass(frozen=True)
class RoleConfig:
    num_ranks: int = doc_field(1, "Number of MPI ranks that take this role.")
    partition: str = doc_field("", "SLURM partition for this role's ranks ('' = the job's default).")

    def validate(self, path: str) -> None:
        if self.num_ranks < 0:
            raise UsageError(f"{path}.num_ranks: must be >= 0, got {self.num_ranks}")


@dataclass(frozen=True)
class RolesConfig:
    controller: RoleConfig = doc_field(RoleConfig, "The single controller rank.")
    rollout: RoleConfig = doc_field(RoleConfig, "Inference engine ranks.")
    env: RoleConfig = doc_field(RoleConfig, "Environment worker ranks.")
    reward: RoleConfig = doc_field(RoleConfig, "Reward worker ranks (elastic pool).")
    trainer: RoleConfig = doc_field(RoleConfig, "Trainer ranks (data parallel).")

    def validate(self, path: str) -> None:
        if self.controller.num_ranks != 1:
            raise UsageError(f"{path}.controller.num_ranks: must be 1, got {self.controller.num_ranks}")
        for name in ("rollout", "env", "trainer"):
            if getattr(self, name).num_ranks < 1:
                raise UsageError(f"{path}.{name}.num_ranks: must be >= 1")


@dataclass(frozen=True)
class ClusterConfig:
    peer_timeout_s: float = doc_field(120.0, "Longest wait on another rank (receive, collective) before an error.")
    torch_backend: Literal["auto", "gloo", "nccl"] = doc_field(
        "auto", "torch.distributed backend: 'auto' is NCCL when CUDA is available, else gloo."
    )
    launch_timeout_s: float = doc_field(0.0, "Local launcher: end the whole world after this long (0 = never).")

    def validate(self, path: str) -> None:
        if self.peer_timeout_s <= 0:
            raise UsageError(f"{path}.peer_timeout_s: must be > 0, got {self.peer_timeout_s}")
        if self.launch_timeout_s < 0:
            raise UsageError(f"{path}.launch_timeout_s: must be >= 0, got {self.launch_timeout_s}")


@dataclass(frozen=True)
class SmokeConfig:
    num_rounds: int = doc_field(2, "Heartbeat rounds between every pair of ranks.")
    tensor_numel: int = doc_field(4096, "Elements of the tensor broadcast from the first trainer to rollout ranks.")
    fail_rank: int = doc_field(-1, "Test only: this rank raises an error during the smoke job (-1 = none).")
    silent_rank: int = doc_field(-1, "Test only: this rank never answers its peers (-1 = none).")

    def validate(self, path: str) -> None:
        if self.num_rounds < 1 or self.tensor_numel < 1:
            raise UsageError(f"{path}: num_rounds and tensor_numel must be >= 1")


@dataclass(frozen=True)
class Config:
    run: RunConfig = doc_field(RunConfig, "What to run.")
    roles: RolesConfig = doc_field(RolesConfig, "Ranks per role (and their SLURM partitions).")
    cluster: ClusterConfig = doc_field(ClusterConfig, "Process world, timeouts, communication backend.")
    smoke: SmokeConfig = doc_field(SmokeConfig, "The smoke job (run.job = 'smoke').")
