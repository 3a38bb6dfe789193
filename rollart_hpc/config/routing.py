"""The [routing] section: how env ranks route each LLM turn to a rollout pool and a rank in it. Torch-free.

Policies: 'hash' (a hash of the episode id over all rollout ranks, pools ignored: the single-pool
behaviour), 'static' (a family-to-pool map, else the first pool sharing a task tag, else any pool),
'adaptive' (starts from the static map and re-maps families to pools from measured prefill/decode costs,
see `rollart_hpc.routing.affinity`). Static and adaptive pick the least-loaded rank of the chosen pool and
fall back to another pool while every rank of it is saturated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollart_hpc.config.loader import check_bounds, doc_field
from rollart_hpc.contracts.errors import UsageError

RoutingPolicy = Literal["hash", "static", "adaptive"]


@dataclass(frozen=True)
class RoutingConfig:
    policy: RoutingPolicy = doc_field(
        "hash",
        "'hash': episode id hash over all rollout ranks (pools ignored); 'static': task affinity "
        "(families map, then pool tags) to the least-loaded rank of a pool with fallback; 'adaptive': "
        "static, then families re-mapped to pools from measured prefill/decode throughput.",
    )
    families: dict[str, str] = doc_field(
        {}, "Family -> pool name (static map; the adaptive policy's starting map). Absent: by tags."
    )
    saturation: float = doc_field(
        1.0,
        "A rank is saturated when its queued + running requests reach this times its pool's engine slots; "
        "a turn whose pool has only saturated ranks falls back to the least-loaded other pool.",
    )
    sticky: bool = doc_field(
        False,
        "Keep every turn of an episode on the rank that served its first turn while that rank is not "
        "saturated: set it where the engine keeps a prefix cache (vLLM; the built-in engine's prefix cache).",
    )
    adapt_every_s: float = doc_field(2.0, "Adaptive: seconds between two affinity decisions.")
    hysteresis: float = doc_field(
        0.2, "Adaptive: a new mapping is taken only if its projected makespan is this fraction lower."
    )
    min_share: float = doc_field(
        0.02, "Adaptive: smallest share of each family's turns sent to every pool (keeps costs measured)."
    )

    def validate(self, path: str) -> None:
        check_bounds(self, path, saturation="> 0")
        if self.adapt_every_s <= 0 or not 0 <= self.hysteresis < 1:
            raise UsageError(f"{path}: adapt_every_s > 0 and 0 <= hysteresis < 1 required")
        if not 0 <= self.min_share < 0.5:
            raise UsageError(f"{path}.min_share: must be in [0, 0.5), got {self.min_share}")
        if self.policy == "hash" and (self.families or self.sticky):
            raise UsageError(
                f"{path}.policy: 'hash' ignores families and sticky; remove them or pick 'static'"
            )

    def check_pools(self, pools: list[str], families: list[str]) -> None:
        """Every mapped family is a run family and every mapped pool exists (cross-section check)."""
        for family, pool in self.families.items():
            if family not in families:
                raise UsageError(f"routing.families.{family}: not one of envs.families {families}")
            if pool not in pools:
                raise UsageError(f"routing.families.{family}: pool {pool!r} is not one of {pools}")
