"""The run plan: which world ranks take which role (and, on SLURM, which partition). Torch- and MPI-free.

The rollout role may span several consecutive ranges, one per named pool (`roles.rollout_pools`); every
other role, and a run with one pool, has one range per role. `ranks_of("rollout")` is all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollart_hpc.config.roles import DEFAULT_POOL, RolloutPoolConfig
from rollart_hpc.config.schema import ROLE_NAMES, RoleConfig, RolesConfig


@dataclass(frozen=True)
class RoleRange:
    role: str
    start: int
    num_ranks: int
    partition: str
    resources: RoleConfig = field(default_factory=RoleConfig, compare=False)
    """The role's config: GPUs, CPUs and memory per rank, ranks per node, SLURM constraints."""
    pool: str = ""
    """The rollout pool of this range ('' = the role's only range)."""

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.num_ranks)


@dataclass(frozen=True)
class RunPlan:
    """Contiguous rank ranges per role, in the fixed order of ROLE_NAMES (controller is rank 0)."""

    roles: tuple[RoleRange, ...]

    @property
    def world_size(self) -> int:
        return sum(r.num_ranks for r in self.roles)

    def role_of(self, rank: int) -> RoleRange:
        for role in self.roles:
            if rank in role.ranks:
                return role
        raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")

    def ranks_of(self, role: str) -> range:
        return self.range_of(role).ranks

    def range_of(self, role: str) -> RoleRange:
        """The role's ranks as one range (a pooled rollout role: its pools' ranges joined)."""
        parts = [r for r in self.roles if r.role == role]
        if not parts:
            raise KeyError(f"no role {role!r} in the plan (roles: {', '.join(ROLE_NAMES)})")
        if len(parts) == 1:
            return parts[0]
        return RoleRange(role, parts[0].start, sum(r.num_ranks for r in parts), parts[0].partition)

    def pools(self) -> dict[str, range]:
        """Rollout pool name -> its world ranks, in rank order (one pool 'default' without named pools)."""
        return {r.pool or DEFAULT_POOL: r.ranks for r in self.roles if r.role == "rollout"}

    def describe(self, rank: int) -> str:
        """'env rank 3 (env #1)': how errors name a peer."""
        role = self.role_of(rank)
        start = self.range_of(role.role).start
        pool = f", pool {role.pool}" if role.pool else ""
        return f"{role.role} rank {rank} ({role.role} #{rank - start}{pool})"

    def table(self) -> str:
        lines = [f"world size {self.world_size}"]
        for r in self.roles:
            if r.num_ranks:
                span = f"{r.start}" if r.num_ranks == 1 else f"{r.start}-{r.start + r.num_ranks - 1}"
                part = f"  partition={r.partition}" if r.partition else ""
                pool = f"  pool={r.pool}{pool_text(r.resources)}" if r.pool else ""
                lines.append(
                    f"  {r.role:<10} ranks {span:<7} ({r.num_ranks}){part}{pool}{resource_text(r.resources)}"
                )
        return "\n".join(lines)


def set_parts(*items: tuple[object, str]) -> list[str]:
    """The texts of the (value, text) pairs whose value is set, in order: the optional parts of a
    resource description or request."""
    return [text for value, text in items if value]


def resource_text(cfg: RoleConfig) -> str:
    """'  per rank: 1 GPU, 8 CPUs, 64G' ('' when the role asks for nothing)."""
    parts = set_parts(
        (cfg.gpus_per_rank, f"{cfg.gpus_per_rank} GPU{'s' if cfg.gpus_per_rank > 1 else ''}"),
        (cfg.cpus_per_rank, f"{cfg.cpus_per_rank} CPU{'s' if cfg.cpus_per_rank > 1 else ''}"),
        (cfg.mem_gb, f"{cfg.mem_gb}G"),
    )
    return f"  per rank: {', '.join(parts)}" if parts else ""


def pool_text(cfg: RoleConfig) -> str:
    """'  gpu=h800 tags=prefill' for a pool's GPU type, constraint and tags ('' when none)."""
    tags = cfg.tags if isinstance(cfg, RolloutPoolConfig) else ()
    parts = set_parts(
        (cfg.gpu_type, f"gpu={cfg.gpu_type}"),
        (cfg.constraint, f"constraint={cfg.constraint}"),
        (tags, f"tags={','.join(tags)}"),
    )
    return f" ({' '.join(parts)})" if parts else ""


def make_plan(roles: RolesConfig) -> RunPlan:
    ranges, start = [], 0
    for name in ROLE_NAMES:
        if name == "rollout" and roles.rollout_pools:
            for pool in roles.rollout_pools:
                ranges.append(RoleRange(name, start, pool.num_ranks, pool.partition, pool, pool.name))
                start += pool.num_ranks
            continue
        cfg = getattr(roles, name)
        ranges.append(RoleRange(name, start, cfg.num_ranks, cfg.partition, cfg))
        start += cfg.num_ranks
    return RunPlan(tuple(ranges))
