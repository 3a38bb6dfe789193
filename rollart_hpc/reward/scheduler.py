"""The reward service's queueing logic: per-client queues served round robin, a per-client quota, and
idempotent request ids. No zmq, no event loop: the service calls it and sends what it returns.

Dataflow: `submit(peer, client, id, input)` either answers at once (a cached result: the request was
scored before; or a refusal: the client's quota is full) or queues the request (or, if the same id is
already queued or being scored, only remembers one more peer to answer). `next()` takes the next request
round robin over the clients that have one queued. `complete(key, reply)` caches the reply and returns
the peers waiting for it.
Invariant: a (client, id) is scored at most once while its result is cached (the cache keeps the last
`cache_size` results, and is re-filled from the service's results journal after a restart); every peer
that sent it gets one reply per send.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from rollart_hpc.reward.functions import RewardInput

Key = tuple[str, str]


@dataclass
class ClientCounts:
    requests: int = 0
    scored: int = 0
    cached: int = 0
    refused: int = 0


@dataclass
class FairScheduler:
    quota: int
    cache_size: int = 100_000
    queues: dict[str, deque[tuple[Key, RewardInput]]] = field(default_factory=dict)
    order: deque[str] = field(default_factory=deque)
    waiting: dict[Key, list[Hashable]] = field(default_factory=dict)
    results: OrderedDict[Key, dict[str, Any]] = field(default_factory=OrderedDict)
    counts: dict[str, ClientCounts] = field(default_factory=dict)
    in_service: dict[str, int] = field(default_factory=dict)

    def submit(self, peer: Hashable, client: str, rid: str, inp: RewardInput) -> dict[str, Any] | None:
        """A reply to send now (cached result or refusal), or None when the request is queued."""
        key = (client, rid)
        counts = self.counts.setdefault(client, ClientCounts())
        counts.requests += 1
        if key in self.results:
            counts.cached += 1
            return {**self.results[key], "cached": True}
        if key in self.waiting:
            self.waiting[key].append(peer)
            return None
        if self.in_service.get(client, 0) >= self.quota:
            counts.refused += 1
            return {
                "id": rid,
                "status": "error",
                "retry": True,
                "error": f"quota of {self.quota} requests full",
            }
        self.waiting[key] = [peer]
        self.in_service[client] = self.in_service.get(client, 0) + 1
        queue = self.queues.setdefault(client, deque())
        if not queue:
            self.order.append(client)
        queue.append((key, inp))
        return None

    def next(self) -> tuple[Key, RewardInput] | None:
        """The next queued request, round robin over clients; None when nothing is queued."""
        if not self.order:
            return None
        client = self.order.popleft()
        queue = self.queues[client]
        item = queue.popleft()
        if queue:
            self.order.append(client)
        return item

    def complete(self, key: Key, reply: dict[str, Any]) -> list[Hashable]:
        """Cache the reply of a scored request; the peers to send it to."""
        self.remember(key, reply)
        if reply.get("status") == "ok":
            self.counts.setdefault(key[0], ClientCounts()).scored += 1
        self.in_service[key[0]] -= 1
        return self.waiting.pop(key, [])

    def remember(self, key: Key, reply: dict[str, Any]) -> None:
        self.results[key] = reply
        self.results.move_to_end(key)
        while len(self.results) > self.cache_size:
            self.results.popitem(last=False)

    def queued(self) -> int:
        return sum(len(q) for q in self.queues.values())
