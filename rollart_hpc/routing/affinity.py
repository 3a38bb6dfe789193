"""Adaptive hardware affinity: which share of each task family's turns each rollout pool serves, chosen
from measured costs to minimise the projected rollout makespan. Pure functions, standard library only.

Model. Pool p's engines cost `prefill_s` seconds per prefill token and `decode_s` per decode token
(a least-squares fit of step seconds on the step's prefill and decode tokens, summed over the pool's
ranks: `pool_cost`). Family f's recent turns number `turns` with mean `prefill` prompt tokens and
`decode` generated tokens each. Serving a share x[f][p] of f's turns on p takes
    load[p] = sum_f x[f][p] * turns_f * (prefill_f * prefill_s_p + decode_f * decode_s_p) / ranks_p
seconds of engine time per rank; the projected makespan is max_p load[p].

Search (`best_shares`): every family starts on its cheapest pool; then, while it lowers the makespan,
a step of share moves from the busiest pool to the pool where that family's turns raise the makespan
least. Every share stays >= `min_share` (exploration: each pool keeps being measured for each family).
`decide` takes the new shares only when their makespan is at least `hysteresis` below that of the
current shares under the same costs, and returns its numbers so every decision can be logged.
"""

from __future__ import annotations

from dataclasses import dataclass

Shares = dict[str, dict[str, float]]


@dataclass(frozen=True)
class PoolCost:
    prefill_s: float
    decode_s: float
    ranks: int


@dataclass(frozen=True)
class FamilyWork:
    turns: float
    prefill: float
    decode: float


@dataclass(frozen=True)
class Decision:
    shares: Shares
    switched: bool
    makespan_current: float
    makespan_best: float
    loads: dict[str, float]

    def to_dict(self) -> dict[str, object]:
        return {
            "shares": self.shares,
            "switched": self.switched,
            "makespan_current_s": round(self.makespan_current, 6),
            "makespan_best_s": round(self.makespan_best, 6),
            "pool_load_s": {p: round(v, 6) for p, v in self.loads.items()},
        }


def pool_cost(fit: tuple[float, float, float, float, float], ranks: int) -> PoolCost | None:
    """Per-token costs from the sums (p*p, p*d, d*d, t*p, t*d) of a pool's steps; None while the fit is
    singular or not positive (too few or too uniform steps)."""
    pp, pd, dd, tp, td = fit
    det = pp * dd - pd * pd
    if pp <= 0 or dd <= 0 or det <= 1e-9 * pp * dd:
        return None
    a = (tp * dd - td * pd) / det
    b = (td * pp - tp * pd) / det
    if a <= 0 or b <= 0:
        return None
    return PoolCost(a, b, ranks)


def turn_cost(work: FamilyWork, cost: PoolCost) -> float:
    return work.prefill * cost.prefill_s + work.decode * cost.decode_s


def pool_loads(shares: Shares, work: dict[str, FamilyWork], costs: dict[str, PoolCost]) -> dict[str, float]:
    loads = dict.fromkeys(costs, 0.0)
    for family, split in shares.items():
        if family not in work:
            continue
        for pool, share in split.items():
            if pool in costs:
                w = work[family]
                loads[pool] += share * w.turns * turn_cost(w, costs[pool]) / costs[pool].ranks
    return loads


def makespan(shares: Shares, work: dict[str, FamilyWork], costs: dict[str, PoolCost]) -> float:
    return max(pool_loads(shares, work, costs).values(), default=0.0)


def initial_shares(work: dict[str, FamilyWork], costs: dict[str, PoolCost], min_share: float) -> Shares:
    """Every family on its cheapest pool, the others at min_share."""
    shares: Shares = {}
    for family, w in work.items():
        best = min(costs, key=lambda p: turn_cost(w, costs[p]))
        split = {p: min_share for p in costs}
        split[best] = 1.0 - min_share * (len(costs) - 1)
        shares[family] = split
    return shares


def best_shares(
    work: dict[str, FamilyWork], costs: dict[str, PoolCost], min_share: float, step: float = 0.05
) -> Shares:
    """The shares found by moving `step` at a time off the busiest pool while the makespan drops."""
    shares = initial_shares(work, costs, min_share)
    current = makespan(shares, work, costs)
    for _ in range(int(len(work) * len(costs) / step) + 1):
        loads = pool_loads(shares, work, costs)
        busiest = max(loads, key=lambda p: loads[p])
        moved = _best_move(shares, work, costs, busiest, min_share, step)
        if moved is None or makespan(moved, work, costs) >= current - 1e-12:
            break
        shares, current = moved, makespan(moved, work, costs)
    return shares


def _best_move(
    shares: Shares,
    work: dict[str, FamilyWork],
    costs: dict[str, PoolCost],
    src: str,
    min_share: float,
    step: float,
) -> Shares | None:
    best: tuple[float, Shares] | None = None
    for family, split in shares.items():
        amount = min(step, split.get(src, 0.0) - min_share)
        if amount <= 1e-12:
            continue
        for dst in costs:
            if dst == src:
                continue
            trial = {f: dict(s) for f, s in shares.items()}
            trial[family][src] -= amount
            trial[family][dst] = trial[family].get(dst, 0.0) + amount
            span = makespan(trial, work, costs)
            if best is None or span < best[0]:
                best = (span, trial)
    return None if best is None else best[1]


def decide(
    current: Shares,
    work: dict[str, FamilyWork],
    costs: dict[str, PoolCost],
    hysteresis: float,
    min_share: float,
) -> Decision:
    """Keep `current` unless the best shares' projected makespan is `hysteresis` (a fraction) lower."""
    best = best_shares(work, costs, min_share)
    now, new = makespan(current, work, costs), makespan(best, work, costs)
    switched = new < now * (1.0 - hysteresis)
    chosen = best if switched else current
    return Decision(_rounded(chosen), switched, now, new, pool_loads(chosen, work, costs))


def _rounded(shares: Shares) -> Shares:
    return {f: {p: round(v, 4) for p, v in split.items()} for f, split in shares.items()}
