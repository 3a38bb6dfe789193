"""What a rollout rank measures of its engine for routing: its load, and per step its prefill and decode
tokens and seconds; plus the explicit cost profile that stands in for unequal hardware on CPU.

Load: queued + running requests and tokens (prompt + max new tokens of every request the rank holds),
kept by the rank loop from what it was asked, so it holds for every engine.

Costs: the built-in engine's lifetime counters `prefill_tokens` / `decode_tokens` give each step's tokens
(where an engine lacks them, `planned_tokens` reads the step's plan before it runs); the step's
seconds are then fitted as t = a * prefill + b * decode by least squares (`StepMeter.fit`, summed over
steps and, by the router, over a pool's ranks). Engines that do not expose their plan (vLLM) report load
only.

Cost profile (`roles.rollout_pools[i].prefill_cost_scale` / `decode_cost_scale`): a step that took t
seconds with p prefill and d decode tokens is stretched to t * (sp * p + sd * d) / (p + d) by sleeping
the difference: the prefill share of the step (by tokens) costs sp times its measured time, the decode
share sd times. On a CPU box this separates two pools where the machine cannot (both see the same
cores); the benchmark names the profile it used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollart_hpc.inference.api import Engine
from rollart_hpc.rollout.resilient import ResilientEngine


@dataclass(frozen=True)
class CostProfile:
    """How much longer than measured the prefill and decode shares of a step take (1, 1 = as measured)."""

    prefill_scale: float = 1.0
    decode_scale: float = 1.0

    def stretch(self, seconds: float, prefill: int, decode: int) -> float:
        """The step's seconds under the profile."""
        if prefill + decode == 0:
            return seconds
        return seconds * (self.prefill_scale * prefill + self.decode_scale * decode) / (prefill + decode)


def _inner(engine: Engine) -> object:
    return engine.engine if isinstance(engine, ResilientEngine) else engine


def engine_counters(engine: Engine) -> tuple[int, int] | None:
    """The engine's lifetime (prefill, decode) token counters, where it keeps them."""
    inner = _inner(engine)
    prefill, decode = getattr(inner, "prefill_tokens", None), getattr(inner, "decode_tokens", None)
    return (prefill, decode) if isinstance(prefill, int) and isinstance(decode, int) else None


def planned_tokens(engine: Engine) -> tuple[int, int] | None:
    """(prefill, decode) tokens the next step of a built-in engine forwards; None for other engines.
    Mirrors `LLMEngine._admit` and `_plan` without changing the engine."""
    from rollart_hpc.inference.engine import LLMEngine  # torch: only on a rollout rank

    inner = _inner(engine)
    if not isinstance(inner, LLMEngine):
        return None
    free = max(0, inner.num_slots - len(inner._running))
    reqs = list(inner._running) + list(inner._waiting)[:free]
    todo = [len(r.prompt) + len(r.output) - r.cached for r in reqs]
    decode = sum(1 for n in todo if n == 1)
    budget, prefill = inner.max_num_batched_tokens - decode, 0
    for n in todo:
        if n <= 1 or (budget <= 0 and not inner.batch_invariant):
            continue
        take = n if inner.batch_invariant else min(n, budget)
        prefill, budget = prefill + take, budget - take
    return prefill, decode


@dataclass
class StepMeter:
    """Per-rank step accounting: tokens, busy seconds and the least-squares sums of t ~ a p + b d."""

    profile: CostProfile = field(default_factory=CostProfile)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    busy_s: float = 0.0
    steps: int = 0
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)

    def run_step(self, engine: Engine) -> list:  # type: ignore[type-arg]
        """One engine step, stretched by the profile and recorded; returns the step's outputs."""
        before = engine_counters(engine)
        planned = planned_tokens(engine) if before is None else None
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        after = engine_counters(engine)
        if before is not None and after is not None:
            planned = (max(0, after[0] - before[0]), max(0, after[1] - before[1]))
        if planned is not None:
            prefill, decode = planned
            stretched = self.profile.stretch(seconds, prefill, decode)
            if stretched > seconds:
                time.sleep(stretched - seconds)
            self.record(prefill, decode, stretched)
        else:
            self.record(0, 0, seconds)
        return outputs

    def record(self, prefill: int, decode: int, seconds: float) -> None:
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.busy_s += seconds
        self.steps += 1
        for i, value in enumerate(
            (prefill * prefill, prefill * decode, decode * decode, seconds * prefill, seconds * decode)
        ):
            self.sums[i] += value

    @property
    def fit(self) -> tuple[float, float, float, float, float]:
        pp, pd, dd, tp, td = self.sums
        return (pp, pd, dd, tp, td)
