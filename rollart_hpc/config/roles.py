"""The [roles] section: ranks per role, their SLURM resources, and the rollout role's named pools.

A run's rollout role is either `roles.rollout` (one pool, named "default") or a list of named pools
(`[[roles.rollout_pools]]`), each with its own ranks, partition, resources, engine settings and tags;
`roles.rollout.num_ranks` is then their sum. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from rollart_hpc.config.loader import check_bounds, doc_field
from rollart_hpc.contracts.errors import UsageError

DEFAULT_POOL = "default"

# sbatch options that `launch.py submit` renders from a role's fields; `sbatch_extra` may not set them.
RENDERED_SBATCH_OPTIONS = (
    "partition", "ntasks", "nodes", "ntasks-per-node", "gres", "gpus", "gpus-per-task", "gpus-per-node",
    "cpus-per-task", "mem", "mem-per-cpu", "mem-per-gpu", "constraint", "job-name", "output", "time",
    "signal", "requeue", "open-mode", "hetjob",
)  # fmt: skip
SBATCH_EXTRA = re.compile(r"--([a-z][a-z0-9-]*)(=\S+)?")
SLURM_WORD = re.compile(r"[A-Za-z0-9_.\-]+")
SLURM_CONSTRAINT = re.compile(r"[A-Za-z0-9_.\-&|\[\]()*,]+")


@dataclass(frozen=True)
class RoleConfig:
    num_ranks: int = doc_field(1, "Number of MPI ranks that take this role.")
    partition: str = doc_field("", "SLURM partition for this role's ranks ('' = the job's default).")
    gpus_per_rank: int = doc_field(
        0,
        "GPUs of one rank (0 = the rank runs on CPU). Ranks of a node get distinct GPUs (cluster/placement).",
    )
    cpus_per_rank: int = doc_field(
        0,
        "CPU cores of one rank: SLURM --cpus-per-task (the most of a job component's roles), torch/OMP "
        "threads of the rank, and locally an affinity mask of that many cores (0 = no request, no pinning).",
    )
    mem_gb: int = doc_field(
        0,
        "Memory of one rank, GiB; a job component asks --mem for the sum over its busiest node (0 = default).",
    )
    ranks_per_node: int = doc_field(
        0,
        "SLURM: ranks of this role's job component per node (--ntasks-per-node; the roles of one component "
        "must agree). 0 = the component's ranks share one node.",
    )
    gpu_type: str = doc_field("", "SLURM GPU type in the gres request, e.g. 'h100' -> --gres=gpu:h100:N.")
    gpu_memory_gb: float = doc_field(
        0.0,
        "Memory of one GPU of this role, GB, for the memory plan (`launch.py plan --memory`). 0 = from "
        "gpu_type when it names a known GPU (rollart_hpc/plan/gpus.py), else unknown: reported, never refused.",
    )
    constraint: str = doc_field("", "SLURM --constraint (node features), e.g. 'h100&ib'.")
    sbatch_extra: list[str] = doc_field(
        [], "Extra sbatch options of this role's job component, e.g. ['--account=proj', '--qos=high']."
    )

    def validate(self, path: str) -> None:
        counts = ("num_ranks", "gpus_per_rank", "cpus_per_rank", "mem_gb", "ranks_per_node")
        check_bounds(self, path, **dict.fromkeys(counts, ">= 0"))
        if self.gpu_type:
            check_slurm_word(f"{path}.gpu_type", self.gpu_type)
        if self.gpu_type and not self.gpus_per_rank:
            raise UsageError(f"{path}.gpu_type: set, but {path}.gpus_per_rank is 0; remove it")
        if self.gpu_memory_gb < 0 or (self.gpu_memory_gb and not self.gpus_per_rank):
            raise UsageError(f"{path}.gpu_memory_gb: must be >= 0, and 0 when {path}.gpus_per_rank is 0")
        if self.constraint and not SLURM_CONSTRAINT.fullmatch(self.constraint):
            raise UsageError(f"{path}.constraint: {self.constraint!r} is not a SLURM feature expression")
        for line in self.sbatch_extra:
            check_sbatch_extra(f"{path}.sbatch_extra", line)


def check_slurm_word(path: str, value: str) -> None:
    """`value` goes into a SLURM option or a name as one word: letters, digits, _ . - only."""
    if not SLURM_WORD.fullmatch(value):
        raise UsageError(f"{path}: {value!r} must be one word (letters, digits, _ . -)")


def check_sbatch_extra(path: str, line: str) -> None:
    """One `--option[=value]` sbatch line that `launch.py submit` does not render itself."""
    match = SBATCH_EXTRA.fullmatch(line)
    if match is None:
        raise UsageError(f"{path}: {line!r} is not of the form --option or --option=value (no spaces)")
    if match.group(1) in RENDERED_SBATCH_OPTIONS:
        raise UsageError(
            f"{path}: {line!r} sets --{match.group(1)}, which submit renders from the role's fields"
        )


@dataclass(frozen=True)
class RolloutPoolConfig(RoleConfig):
    """One named rollout pool: a RoleConfig (its ranks and SLURM resources) plus engine settings and tags."""

    name: str = doc_field("", "Pool name (one word), used by routing.families and in metrics.")
    tags: list[str] = doc_field(
        [], "Task tags this pool serves (static routing: a task goes to the first pool sharing a tag)."
    )
    num_slots: int = doc_field(0, "Engine slots of one rank of this pool (0 = rollout.num_slots).")
    num_threads: int = doc_field(0, "torch threads of one rank of this pool (0 = rollout.num_threads).")
    prefill_cost_scale: float = doc_field(
        1.0,
        "Built-in engine only, for CPU stand-ins of unequal hardware: each engine step is stretched so its "
        "prefill share (by tokens) takes this many times its measured time (1 = as measured).",
    )
    decode_cost_scale: float = doc_field(
        1.0, "Like prefill_cost_scale, for the decode share of each engine step (1 = as measured)."
    )

    def validate(self, path: str) -> None:
        super().validate(path)
        check_slurm_word(f"{path}.name", self.name)
        if self.num_ranks < 1:
            raise UsageError(f"{path}.num_ranks: a pool needs >= 1 rank, got {self.num_ranks}")
        check_bounds(self, path, num_slots=">= 0", num_threads=">= 0")
        check_bounds(self, path, prefill_cost_scale=">= 1", decode_cost_scale=">= 1")

    @property
    def has_cost_profile(self) -> bool:
        return self.prefill_cost_scale != 1.0 or self.decode_cost_scale != 1.0


def role_fields(cfg: RoleConfig) -> dict[str, object]:
    """The RoleConfig fields of `cfg` (a pool's resources without its pool settings)."""
    return {f.name: getattr(cfg, f.name) for f in fields(RoleConfig)}


@dataclass(frozen=True)
class RolesConfig:
    controller: RoleConfig = doc_field(RoleConfig, "The single controller rank.")
    rollout: RoleConfig = doc_field(
        RoleConfig,
        "Inference engine ranks: the one pool 'default' (with rollout_pools: only num_ranks, derived).",
    )
    env: RoleConfig = doc_field(RoleConfig, "Environment worker ranks.")
    reward: RoleConfig = doc_field(RoleConfig, "Reward worker ranks (elastic pool).")
    trainer: RoleConfig = doc_field(RoleConfig, "Trainer ranks (data parallel).")
    rollout_pools: list[RolloutPoolConfig] = doc_field(
        [],
        "Named rollout pools ([[roles.rollout_pools]]), in rank order; each is its own SLURM job component. "
        "Empty: roles.rollout is the one pool.",
    )

    def __post_init__(self) -> None:
        if not self.rollout_pools:
            return
        total = sum(p.num_ranks for p in self.rollout_pools)
        if self.rollout not in (RoleConfig(), RoleConfig(num_ranks=total)):
            raise UsageError(
                "roles.rollout: set the rollout resources in roles.rollout_pools, not both (num_ranks is "
                f"their sum, {total})"
            )
        object.__setattr__(self, "rollout", RoleConfig(num_ranks=total))

    def validate(self, path: str) -> None:
        if self.controller.num_ranks != 1:
            raise UsageError(f"{path}.controller.num_ranks: must be 1, got {self.controller.num_ranks}")
        for name in ("rollout", "env", "trainer"):
            if getattr(self, name).num_ranks < 1:
                raise UsageError(f"{path}.{name}.num_ranks: must be >= 1")
        names = [p.name for p in self.rollout_pools]
        if len(set(names)) != len(names):
            raise UsageError(f"{path}.rollout_pools: pool names must be distinct, got {names}")

    def pools(self) -> list[RolloutPoolConfig]:
        """The rollout pools in rank order: the named ones, or roles.rollout as the pool 'default'."""
        if self.rollout_pools:
            return list(self.rollout_pools)
        return [RolloutPoolConfig(name=DEFAULT_POOL, **role_fields(self.rollout))]  # type: ignore[arg-type]
