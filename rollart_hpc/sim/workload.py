"""Synthetic agentic workloads: episode shapes drawn from long-tailed distributions, per task family.

Assumptions (the family figures are this model's choices, shaped after RollArt's descriptions, not measured):
- Response lengths per turn are log-normal around a family mean with `response_sigma` 0.75: of 512 draws the
  largest is ~6.6x the mean, inside RollArt §8's "per-step max response length >5x the mean (peak 9x)".
- Turns per episode are 1 + a geometric count with the family's mean, capped at `max_turns`; the context is
  capped at `max_context` tokens (RollArt §7.1: 32K), the episode ending at the turn that would pass it.
- Env step latency is normal (RollArt §7.4 R2's Gaussian) or log-normal with the family's mean and
  standard deviation, truncated at 0; reset and reward (`post_s`) take fixed times per family.
- Families: long-horizon, prefill-heavy SWE-bench, WebShop and FrozenLake; short-turn, decode-heavy GEM-math
  and GEM-game (RollArt §1, §7.1), sampled uniformly (§7.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.sim.profile import EpisodeShape


@dataclass(frozen=True)
class FamilyCost:
    name: str
    prompt: int  # first prompt tokens
    observation: int  # new prompt tokens per later turn
    response: float  # mean generated tokens per turn
    turns: float  # mean turns
    env_s: float  # mean env step seconds
    env_std_s: float
    reset_s: float
    reward_s: float
    weight: float = 1.0


# name -> family; prefill-heavy ones have long observations and short replies, decode-heavy the reverse.
FAMILIES: dict[str, FamilyCost] = {
    "swe": FamilyCost("swe", 3000, 1500, 250, 16, 4.0, 2.0, 20.0, 1.0),
    "webshop": FamilyCost("webshop", 1500, 700, 150, 10, 1.0, 0.5, 2.0, 0.2),
    "frozenlake": FamilyCost("frozenlake", 600, 250, 100, 12, 0.2, 0.1, 0.5, 0.1),
    "gem_math": FamilyCost("gem_math", 300, 0, 3500, 1, 0.2, 0.1, 0.1, 0.5),
    "gem_game": FamilyCost("gem_game", 400, 120, 1200, 3, 0.3, 0.1, 0.2, 0.2),
}
PREFILL_HEAVY = ("swe", "webshop", "frozenlake")
DECODE_HEAVY = ("gem_math", "gem_game")


@dataclass(frozen=True)
class Workload:
    families: tuple[FamilyCost, ...] = tuple(FAMILIES.values())
    response_sigma: float = 0.75
    max_turns: int = 48  # RollArt §8: 1-48 average turns per task
    max_context: int = 32768
    env_distribution: str = "normal"  # or "lognormal"

    def with_env(self, mean_s: float, std_s: float) -> Workload:
        """Every family's env step latency set to `mean_s` +- `std_s`."""
        return replace(self, families=tuple(replace(f, env_s=mean_s, env_std_s=std_s) for f in self.families))


def _env_draw(rng: np.random.Generator, family: FamilyCost, distribution: str) -> float:
    if distribution == "normal":
        return max(float(rng.normal(family.env_s, family.env_std_s)), 0.0)
    if distribution == "lognormal":
        if family.env_s <= 0:
            return 0.0
        var = math.log(1 + (family.env_std_s / family.env_s) ** 2)
        return float(rng.lognormal(math.log(family.env_s) - var / 2, math.sqrt(var)))
    raise UsageError(f"env distribution must be 'normal' or 'lognormal', got {distribution!r}")


def sample_episode(rng: np.random.Generator, family: FamilyCost, w: Workload) -> EpisodeShape:
    turns = 1
    if family.turns > 1:
        turns = min(1 + int(rng.geometric(1.0 / family.turns)) - 1, w.max_turns)
        turns = max(turns, 1)
    mu = math.log(family.response) - w.response_sigma**2 / 2
    prompt, gen, env = [], [], []
    context = 0
    for turn in range(turns):
        q = family.prompt if turn == 0 else family.observation
        k = max(int(rng.lognormal(mu, w.response_sigma)), 1)
        if context + q + k > w.max_context:
            k = max(w.max_context - context - q, 1)
            if context + q >= w.max_context:
                break
        prompt.append(q)
        gen.append(k)
        env.append(_env_draw(rng, family, w.env_distribution))
        context += q + k
        if context >= w.max_context:
            break
    return EpisodeShape(
        reset_s=family.reset_s,
        prompt=tuple(prompt),
        gen=tuple(gen),
        env_s=tuple(env),
        post_s=family.reward_s,
        tokens=context,
        family=family.name,
    )


def sample(w: Workload, n: int, seed: int = 0) -> tuple[EpisodeShape, ...]:
    """`n` episodes, families drawn by weight."""
    rng = np.random.default_rng(seed)
    weights = np.array([f.weight for f in w.families], dtype=float)
    picks = rng.choice(len(w.families), size=n, p=weights / weights.sum())
    return tuple(sample_episode(rng, w.families[i], w) for i in picks)


def mean_context(episodes: tuple[EpisodeShape, ...], families: tuple[str, ...] = ()) -> float:
    """The mean context a decoding request holds: per turn, its history plus half its reply, token-weighted."""
    total, weight = 0.0, 0.0
    for e in episodes:
        if families and e.family not in families:
            continue
        context = 0
        for q, k in zip(e.prompt, e.gen, strict=True):
            context += q
            total += (context + k / 2) * k
            weight += k
            context += k
    return total / weight if weight else 0.0
