"""The weight transport of a run: the first trainer publishes each version to every rollout rank over a
standalone process group (`group.py`), one sender and one receiver (`publisher.py`).

Sending side (`WeightPublisher`, built by `open_publisher`): `publish_stream(version, units)` waits until
the previous version was delivered (one version in flight), announces `version` to every receiver (the
`announce` callback: in a run, a WEIGHTS message on the mailbox from `announce_to`, so an idle rollout
rank knows a broadcast is coming), packs the units into its send buckets as they come, each bucket on
the wire as soon as it is complete, and returns once packed (all but the last `depth` buckets delivered:
the sender holds `depth` bucket buffers, never the model); delivery finishes in the background.
`wait()` blocks until the version in flight is delivered and re-raises a background failure (a receiver
that never joins: `PeerTimeoutError` naming it).

Receiving side (`WeightReceiver`): `receive(on_bucket, into)` blocks (bounded by the timeout) until the
next version is delivered and returns its version, handing each bucket to `on_bucket` as it lands (the
rollout rank lands it in its engine's staging) and holding only the buckets in flight.

Invariants: versions reach every receiver in publish order, each exactly once, bit-identical to what was
packed at publish; an announcement of version v precedes the delivery of v.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from rollart_hpc.cluster.context import RunContext, torch_backend
from rollart_hpc.cluster.world import World
from rollart_hpc.weights.buckets import layout_for
from rollart_hpc.weights.group import Backend, StandaloneGroup, make_standalone_group
from rollart_hpc.weights.publisher import Announce, WeightPublisher

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class _Sends(Protocol):
    def send(self, payload: Any, dest: int, tag: Any) -> None: ...


def announce_to(
    messenger: _Sends, receiver_ranks: Sequence[int], tag: Any, message: Callable[[int], Any] = int
) -> Announce:
    """An `announce` that sends `message(version)` to every receiver rank through `messenger` (a
    `Mailbox` or a `World`); e.g. `announce_to(ctx.mailbox, rollouts, Tag.WEIGHTS, WeightAnnouncement)`."""
    ranks = list(receiver_ranks)

    def announce(version: int) -> None:
        for rank in ranks:
            messenger.send(message(int(version)), rank, tag)

    return announce


def join_weight_group(
    world: World, member_ranks: Sequence[int], backend: Backend, timeout_s: float
) -> StandaloneGroup | None:
    """Collective over `member_ranks` (publisher first, then the receivers): the weights group, or None
    on a rank outside it. Every rank of the world may call it with the same arguments."""
    if world.rank not in member_ranks:
        return None
    return make_standalone_group(world, list(member_ranks), backend, timeout_s)


def join_run_weight_group(ctx: RunContext) -> StandaloneGroup | None:
    """This rank's membership of a run's weights group (the first trainer, then every rollout rank), None
    on other ranks. Members call it first thing, before any other collective."""
    return join_weight_group(
        ctx.world,
        ctx.weight_members,
        torch_backend(ctx.config.cluster, ctx.world.plan, ctx.weight_members),
        ctx.world.timeout_s,
    )


def open_publisher(
    group: StandaloneGroup,
    named_tensors: NamedTensors,
    bucket_mb: float,
    announce: Announce | None = None,
    checksum: bool = False,
    direct_mb: float = 0.0,
    depth: int = 2,
) -> WeightPublisher:
    """Collective with every receiver's `WeightReceiver(group)`: share the bucket layout of
    `named_tensors` (names, shapes, dtypes; contents are not read) in buckets of `bucket_mb` MiB, tensors
    of at least `direct_mb` MiB in buckets of their own (0: none; `buckets.plan_layout`); at most `depth`
    bucket broadcasts in flight, so the sender's buffers are `depth` buckets, never the model."""
    named = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    layout = layout_for(named.items(), int(bucket_mb * 2**20), int(direct_mb * 2**20) or None)
    return WeightPublisher(group, layout, checksum=checksum, announce=announce, depth=depth)
