"""Which rollout rank serves an LLM turn. Standard library only (the simulator uses `rollout_index`).

Policies (`routing.policy`):
- 'hash': every turn of an episode goes to one rank of all rollout ranks, chosen by a hash of the
  episode id (pools ignored; the behaviour of a single-pool run).
- 'static': an episode's pool is its family's (`routing.families`), else the first pool sharing one of
  its task's tags, else the least-loaded pool.
- 'adaptive': each family's episodes are split over the pools by shares (an episode's place in [0, 1),
  a hash of its id, picks the pool, again at each turn unless sticky, so new shares apply to running
  episodes), starting from the static map (even shares without one) with `routing.min_share` on the
  others (a turn drawn for a pool at that floor, an exploration turn, goes there only while the pool is
  idle, else to the family's largest share); every `routing.adapt_every_s` the shares are re-chosen from measured costs
  (`routing.affinity.decide`), and each decision is kept with its numbers (`decisions`).

Within the chosen pool a turn goes to the least-loaded rank (queued + running tokens); with
`routing.sticky` it stays on the rank of the episode's previous turn while that rank is not saturated.
A rank is saturated when its queued + running requests reach `routing.saturation` x its slots; while
every rank of the pool is, the turn falls back to the least-loaded unsaturated rank of another pool
(counted per pool). Load comes from the rollout ranks' LOAD reports (`RankLoad`, sent with each output)
plus what this router sent each rank since its last report.

Invariant: `route` always returns a rollout rank; every request routed is released exactly once
(`on_output`, or `forget` for requests that never got one), so in-flight counts return to zero.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from rollart_hpc.config.routing import RoutingConfig
from rollart_hpc.contracts.ids import RequestId
from rollart_hpc.contracts.records import RankLoad
from rollart_hpc.routing.affinity import FamilyWork, PoolCost, Shares, decide, pool_cost

MIN_FIT_STEPS = 20  # engine steps of a pool before its fitted costs are used (adaptive)
MAX_FALLBACK_EVENTS = 200  # fallbacks recorded with the loads that caused them (the first ones)


def rollout_index(request_id: str, num_rollouts: int) -> int:
    """The index, in 0..num_rollouts-1, of the rollout rank for `request_id` ("<episode id>/<turn>" or the
    episode id itself)."""
    return zlib.crc32(episode_of(request_id).encode()) % num_rollouts


def episode_of(request_id: str) -> str:
    return RequestId.parse(request_id).episode


def unit_hash(key: str) -> float:
    """A stable place of `key` in [0, 1)."""
    return zlib.crc32(f"pool:{key}".encode()) / 2**32


@dataclass(frozen=True)
class PoolSpec:
    name: str
    ranks: tuple[int, ...]
    slots: int
    tags: tuple[str, ...] = ()


@dataclass
class PoolCounters:
    """What the router did for one pool: turns sent (fallbacks included), tokens, fallbacks into and out."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    fallbacks_out: int = 0
    fallbacks_in: int = 0
    by_family: dict[str, int] = field(default_factory=dict)
    fallbacks_by_family: dict[str, int] = field(default_factory=dict)


@dataclass
class _Inflight:
    rank: int
    pool: str
    family: str
    prompt: int


class Router:
    """Routes the turns of one env rank; see the module docstring."""

    def __init__(
        self, routing: RoutingConfig, pools: list[PoolSpec], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.routing, self.pools, self.clock = routing, {p.name: p for p in pools}, clock
        self.all_ranks = [r for p in pools for r in p.ranks]
        self.pool_of_rank = {r: p.name for p in pools for r in p.ranks}
        self.reports: dict[int, RankLoad] = {}
        self.sent: dict[int, list[int]] = {r: [0, 0] for r in self.all_ranks}  # since the last report
        self.episodes: dict[str, tuple[str, tuple[str, ...]]] = {}
        self.episode_pool: dict[str, str] = {}
        self.last_rank: dict[str, int] = {}
        self.inflight: dict[str, _Inflight] = {}
        self.counters = {p.name: PoolCounters() for p in pools}
        self.work: dict[str, list[float]] = {}  # family -> [turns, prompt tokens, generated tokens]
        self.shares: Shares = {}
        self.decisions: list[dict[str, object]] = []
        self.fallback_events: list[dict[str, object]] = []
        self.started = self.last_adapt = clock()

    # ----- episodes -----
    def begin(self, episode_id: str, family: str, tags: tuple[str, ...]) -> None:
        self.episodes[episode_id] = (family, tags)

    def end(self, episode_id: str) -> None:
        for table in (self.episodes, self.episode_pool, self.last_rank):
            table.pop(episode_id, None)

    # ----- routing -----
    def route(self, request_id: str, prompt_tokens: int, max_tokens: int) -> int:
        episode = episode_of(request_id)
        family = self.episodes.get(episode, ("", ()))[0]
        if self.routing.policy == "hash":
            rank, pool = self.all_ranks[rollout_index(request_id, len(self.all_ranks))], ""
        else:
            rank, pool = self._route_pooled(episode)
        pool = pool or self.pool_of_rank[rank]
        self.inflight[request_id] = _Inflight(rank, pool, family, prompt_tokens)
        self.sent[rank][0] += 1
        self.sent[rank][1] += prompt_tokens + max_tokens
        counters = self.counters[pool]
        counters.requests += 1
        counters.prompt_tokens += prompt_tokens
        counters.by_family[family] = counters.by_family.get(family, 0) + 1
        self.last_rank[episode] = rank
        return rank

    def _route_pooled(self, episode: str) -> tuple[int, str]:
        preferred = self.episode_pool.get(episode) or self._pick_pool(episode)
        if self.routing.sticky:  # else the adaptive policy re-picks the pool each turn (new shares apply)
            self.episode_pool[episode] = preferred
        last = self.last_rank.get(episode)
        if self.routing.sticky and last is not None and not self.saturated(last):
            return last, self.pool_of_rank[last]
        rank = self._least_loaded(self.pools[preferred].ranks, unsaturated=True)
        if rank is not None:
            return rank, preferred
        others = [r for p in self.pools.values() if p.name != preferred for r in p.ranks]
        rank = self._least_loaded(others, unsaturated=True)
        if rank is None:  # every pool is saturated: wait in the preferred one
            rank = self._least_loaded(self.pools[preferred].ranks, unsaturated=False)
            assert rank is not None, "a pool has at least one rank"
            return rank, preferred
        self._note_fallback(episode, preferred, rank)
        return rank, self.pool_of_rank[rank]

    def _note_fallback(self, episode: str, preferred: str, rank: int) -> None:
        family = self.episodes.get(episode, ("", ()))[0]
        out = self.counters[preferred]
        out.fallbacks_out += 1
        out.fallbacks_by_family[family] = out.fallbacks_by_family.get(family, 0) + 1
        self.counters[self.pool_of_rank[rank]].fallbacks_in += 1
        if len(self.fallback_events) < MAX_FALLBACK_EVENTS:
            loads = {r: self.load(r)[0] for r in self.pools[preferred].ranks}
            self.fallback_events.append(
                {"family": family, "from": preferred, "to_rank": rank, "from_requests": loads,
                 "from_slots": self.pools[preferred].slots}
            )  # fmt: skip

    def _pick_pool(self, episode: str) -> str:
        family, tags = self.episodes.get(episode, ("", ()))
        if self.routing.policy == "adaptive":
            split = self.shares.get(family) or self._initial_split(family, tags)
            self.shares.setdefault(family, split)
            pool = _by_share(split, unit_hash(episode))
            if split[pool] <= self.routing.min_share + 1e-9 and not self._idle(pool):
                return max(split, key=lambda p: split[p])  # explore only on idle capacity
            return pool
        return self.static_pool(family, tags) or self._least_loaded_pool()

    def static_pool(self, family: str, tags: tuple[str, ...]) -> str | None:
        mapped = self.routing.families.get(family)
        if mapped:
            return mapped
        return next((p.name for p in self.pools.values() if set(p.tags) & set(tags)), None)

    def _initial_split(self, family: str, tags: tuple[str, ...]) -> dict[str, float]:
        pool, n = self.static_pool(family, tags), len(self.pools)
        if pool is None:
            return {p: round(1.0 / n, 4) for p in self.pools}
        floor = self.routing.min_share
        return {p: (1.0 - floor * (n - 1)) if p == pool else floor for p in self.pools}

    def _idle(self, pool: str) -> bool:
        return all(self.load(r)[0] == 0 for r in self.pools[pool].ranks)

    def _least_loaded_pool(self) -> str:
        return min(
            self.pools.values(), key=lambda p: sum(self.load(r)[1] for r in p.ranks) / len(p.ranks)
        ).name

    # ----- load -----
    def load(self, rank: int) -> tuple[int, int]:
        """(requests, tokens) queued + running on `rank`, as last reported plus sent since."""
        report = self.reports.get(rank)
        base = (report.requests, report.tokens) if report else (0, 0)
        return base[0] + self.sent[rank][0], base[1] + self.sent[rank][1]

    def saturated(self, rank: int) -> bool:
        slots = self.pools[self.pool_of_rank[rank]].slots
        return self.load(rank)[0] >= self.routing.saturation * slots

    def _least_loaded(self, ranks: tuple[int, ...] | list[int], unsaturated: bool) -> int | None:
        pick = [r for r in ranks if not (unsaturated and self.saturated(r))]
        if not pick:
            return None
        return min(pick, key=lambda r: (self.load(r)[1] / self.pools[self.pool_of_rank[r]].slots, r))

    def on_load(self, report: RankLoad) -> None:
        if report.rank in self.sent:
            self.reports[report.rank] = report
            self.sent[report.rank] = [0, 0]

    def on_output(self, request_id: str, generated_tokens: int) -> None:
        entry = self.inflight.pop(request_id, None)
        if entry is None:
            return
        self.counters[entry.pool].generated_tokens += generated_tokens
        work = self.work.setdefault(entry.family, [0.0, 0.0, 0.0])
        work[0] += 1
        work[1] += entry.prompt
        work[2] += generated_tokens

    def forget(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)

    # ----- adaptive affinity -----
    def pool_costs(self) -> dict[str, PoolCost]:
        costs = {}
        for pool in self.pools.values():
            reports = [self.reports[r] for r in pool.ranks if r in self.reports]
            if sum(r.steps for r in reports) < MIN_FIT_STEPS:
                continue
            fits = [r.fit for r in reports]
            summed = tuple(sum(f[i] for f in fits) for i in range(5))
            cost = pool_cost(summed, len(pool.ranks))  # type: ignore[arg-type]
            if cost is not None:
                costs[pool.name] = cost
        return costs

    def maybe_adapt(self) -> dict[str, object] | None:
        """Every adapt_every_s under the adaptive policy: re-choose the shares; the decision's record."""
        now = self.clock()
        if self.routing.policy != "adaptive" or now - self.last_adapt < self.routing.adapt_every_s:
            return None
        self.last_adapt = now
        costs = self.pool_costs()
        work = {f: FamilyWork(w[0], w[1] / w[0], w[2] / w[0]) for f, w in self.work.items() if f and w[0]}
        if len(costs) < len(self.pools) or not work:
            return None
        for family in work:
            self.shares.setdefault(family, self._initial_split(family, ()))
        decision = decide(self.shares, work, costs, self.routing.hysteresis, self.routing.min_share)
        self.shares = {f: dict(s) for f, s in decision.shares.items()}
        record = {
            "t_s": round(now - self.started, 3),
            **decision.to_dict(),
            "pool_cost_us_per_token": {
                p: {"prefill": round(c.prefill_s * 1e6, 3), "decode": round(c.decode_s * 1e6, 3)}
                for p, c in costs.items()
            },
            "family_tokens_per_turn": {
                f: {"turns": w.turns, "prefill": round(w.prefill, 1), "decode": round(w.decode, 1)}
                for f, w in work.items()
            },
        }
        self.decisions.append(record)
        return record

    # ----- metrics -----
    def metrics(self) -> dict[str, dict[str, float]]:
        """Per pool: the router's counts and the engines' reported tokens, rates, queue and busy time."""
        elapsed = max(self.clock() - self.started, 1e-9)
        out: dict[str, dict[str, float]] = {}
        for pool in self.pools.values():
            c = self.counters[pool.name]
            reports = [self.reports[r] for r in pool.ranks if r in self.reports]
            busy = sum(r.busy_s for r in reports)
            prefill, decode = sum(r.prefill_tokens for r in reports), sum(r.decode_tokens for r in reports)
            out[pool.name] = {
                "requests": c.requests,
                "prompt_tokens": c.prompt_tokens,
                "generated_tokens": c.generated_tokens,
                "engine_prefill_tokens": prefill,
                "engine_decode_tokens": decode,
                "prefill_tokens_per_s": round(prefill / busy, 1) if busy else 0.0,
                "decode_tokens_per_s": round(decode / busy, 1) if busy else 0.0,
                "queue_depth": sum(self.load(r)[0] for r in pool.ranks),
                "busy_fraction": round(min(1.0, busy / (elapsed * len(pool.ranks))), 4),
                "fallbacks_out": c.fallbacks_out,
                "fallbacks_in": c.fallbacks_in,
                **{f"requests_{f}": n for f, n in sorted(c.by_family.items())},
                **{f"fallbacks_out_{f}": n for f, n in sorted(c.fallbacks_by_family.items())},
            }
        return out


def _by_share(split: dict[str, float], u: float) -> str:
    total, acc = sum(split.values()), 0.0
    for pool, share in split.items():
        acc += share / total
        if u < acc:
            return pool
    return next(reversed(split))
