"""Fault and latency injection for env children (tests and benchmarks), deterministic per seed.

The fault of step `k` of episode `e` is a pure function of (seed, e, k): a `random.Random` seeded with
the string f"{seed}:{e}:{k}" draws one uniform number that picks crash / hang / error / slow / none
by cumulative probability, then the extra latency of that step. So the failures a run will see can be
computed in advance (`expected_cause`) and compared exactly with what the worker counted.
Injection applies to `step` only (never to `reset`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from rollart_hpc.config.derive import derive
from rollart_hpc.config.schema import FaultsConfig

FaultKind = Literal["none", "crash", "hang", "error", "slow"]
CAUSE_OF_FAULT = {"crash": "crash", "hang": "timeout", "error": "error"}


@dataclass(frozen=True)
class LatencyConfig:
    """Extra per-step latency: none, lognormal (median `scale_s`, shape `sigma`) or Pareto (minimum
    `scale_s`, tail index `alpha`); every draw is capped at `max_s`."""

    dist: Literal["none", "lognormal", "pareto"] = "none"
    scale_s: float = 0.01
    sigma: float = 1.0
    alpha: float = 1.5
    max_s: float = 2.0

    def draw(self, rng: random.Random) -> float:
        if self.dist == "none":
            return 0.0
        if self.dist == "lognormal":
            value = self.scale_s * rng.lognormvariate(0.0, self.sigma)
        else:
            value = self.scale_s * rng.paretovariate(self.alpha)
        return min(value, self.max_s)


@dataclass(frozen=True)
class FaultConfig:
    """Per-step probabilities of a crash (the child exits), a hang (it sleeps forever), an error (the
    step raises), a slow step (it sleeps `slow_s`), plus a latency distribution for every step."""

    seed: int = 0
    crash_prob: float = 0.0
    hang_prob: float = 0.0
    error_prob: float = 0.0
    slow_prob: float = 0.0
    slow_s: float = 1.0
    latency: LatencyConfig = field(default_factory=LatencyConfig)

    def __post_init__(self) -> None:
        probs = (self.crash_prob, self.hang_prob, self.error_prob, self.slow_prob)
        if min(probs) < 0 or sum(probs) > 1:
            raise ValueError(f"fault probabilities must be >= 0 and sum to <= 1, got {probs}")

    @property
    def enabled(self) -> bool:
        active = (self.crash_prob, self.hang_prob, self.error_prob, self.slow_prob)
        return any(p > 0 for p in active) or self.latency.dist != "none"


LATENCY_FROM_SECTION = derive(
    LatencyConfig,
    FaultsConfig,
    rename={"dist": "latency", "scale_s": "latency_scale_s", "max_s": "latency_max_s"},
    kept=("sigma", "alpha"),
)
"""A run's step latency: envs.faults.latency, latency_scale_s, latency_max_s."""
FAULTS_FROM_SECTION = derive(
    FaultConfig, FaultsConfig, given=("seed", "latency"), kept=("slow_prob", "slow_s")
)
"""A run's injected faults: the envs.faults probabilities of the same name, seeded with the run seed."""


@dataclass(frozen=True)
class StepFault:
    kind: FaultKind
    delay_s: float


def plan_step(cfg: FaultConfig, episode_id: str, step_index: int) -> StepFault:
    """The fault injected into step `step_index` of episode `episode_id`."""
    rng = random.Random(f"{cfg.seed}:{episode_id}:{step_index}")
    u = rng.random()
    kind: FaultKind = "none"
    edge = 0.0
    for name, prob in (("crash", cfg.crash_prob), ("hang", cfg.hang_prob), ("error", cfg.error_prob)):
        edge += prob
        if u < edge:
            kind = name  # type: ignore[assignment]
            break
    else:
        if u < edge + cfg.slow_prob:
            kind = "slow"
    delay = cfg.latency.draw(rng) + (cfg.slow_s if kind == "slow" else 0.0)
    return StepFault(kind, delay)


def expected_cause(cfg: FaultConfig, episode_id: str, num_steps: int) -> str | None:
    """The failure cause of an episode that would take `num_steps` steps, or None if none is injected."""
    for k in range(num_steps):
        kind = plan_step(cfg, episode_id, k).kind
        if kind in CAUSE_OF_FAULT:
            return CAUSE_OF_FAULT[kind]
    return None
