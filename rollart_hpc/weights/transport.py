"""The weight transport between the publishing trainer and the rollout ranks: one interface, two
implementations (the standalone process group of a run; threads and queues in one process, for tests).

Sending side (`WeightSender`): `publish(version, named)` waits until the previous version was delivered
(one version in flight), announces `version` to every receiver (the `announce` callback: in a run, a
WEIGHTS message on the mailbox, so an idle rollout rank knows a broadcast is coming), takes a snapshot
of the tensors (the caller may change them as soon as it returns) and delivers it in the background.
`wait()` blocks until the version in flight is delivered and re-raises a background failure (a receiver
that never joins: `PeerTimeoutError` naming it).

Receiving side (`WeightSource`): `receive()` blocks (bounded by the timeout) until the next version is
delivered and returns (version, named tensors). The tensors stay valid until the next `receive()`: the
caller hands them to `engine.update_weights`, which copies them, before receiving again.

The group implementation adds two options (see `rollart_hpc.weights.publisher`): `publish(...,
snapshot=False)` returns before packing, the caller leaving its tensors unchanged until `wait_packed()`
(nothing to wait for when it hands over tensors it never touches again, e.g. a fresh copy);
`receive(on_bucket)` hands each bucket's named views to the caller as soon as it lands, while the next
buckets are on the wire, so the caller's copy overlaps the transfer.

Invariants: versions reach every receiver in publish order, each exactly once, bit-identical to the
snapshot taken at publish; an announcement of version v precedes the delivery of v.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from rollart_hpc.cluster.context import RunContext, torch_backend
from rollart_hpc.cluster.world import World
from rollart_hpc.contracts.errors import PeerTimeoutError
from rollart_hpc.weights.buckets import layout_for
from rollart_hpc.weights.group import Backend, StandaloneGroup, make_standalone_group
from rollart_hpc.weights.publisher import BucketConsumer, WeightPublisher, WeightReceiver

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Received = tuple[int, list[tuple[str, torch.Tensor]]]
Announce = Callable[[int], None]


class WeightSender(Protocol):
    """The publishing side (see the module docstring)."""

    def publish(self, version: int, named_tensors: NamedTensors, *, snapshot: bool = True) -> None:
        """Announce and send `version`. `snapshot=False`: the caller hands over tensors it never changes
        again (e.g. fresh copies), so the sender need not copy them before it returns."""
        ...

    def publish_stream(self, version: int, chunks: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Announce and send `version` from chunks of named tensors (together the whole model, e.g. one
        gathered unit at a time); a snapshot, as `publish`: the chunks may change once it returns."""
        ...

    def wait(self) -> None: ...


class WeightSource(Protocol):
    """The receiving side (see the module docstring)."""

    def receive(self) -> Received: ...


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


def _named_dict(named: NamedTensors) -> dict[str, torch.Tensor]:
    return dict(named.items() if isinstance(named, Mapping) else named)


# ----- over the standalone process group of a run -----
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


class GroupWeightSender:
    """`WeightSender` over a `StandaloneGroup` (bucketed asynchronous broadcast, `WeightPublisher`)."""

    def __init__(self, publisher: WeightPublisher, announce: Announce | None = None) -> None:
        self.publisher = publisher
        self.announce = announce

    @classmethod
    def open(
        cls,
        group: StandaloneGroup,
        named_tensors: NamedTensors,
        bucket_mb: float,
        announce: Announce | None = None,
        checksum: bool = False,
        direct_mb: float = 0.0,
    ) -> GroupWeightSender:
        """Collective with every receiver's `GroupWeightReceiver.open`: share the bucket layout of
        `named_tensors` (names, shapes, dtypes; contents are not read) in buckets of `bucket_mb` MiB,
        tensors of at least `direct_mb` MiB in buckets of their own (0: none; `buckets.plan_layout`)."""
        named = _named_dict(named_tensors)
        layout = layout_for(named.items(), int(bucket_mb * 2**20), int(direct_mb * 2**20) or None)
        return cls(WeightPublisher(group, layout, checksum=checksum), announce)

    def publish(self, version: int, named_tensors: NamedTensors, *, snapshot: bool = True) -> None:
        """`WeightSender.publish`; `snapshot=False` defers the packing (see `WeightPublisher.publish`):
        the caller leaves its tensors unchanged until `wait_packed()` returns."""
        self.publisher.wait()
        if self.announce is not None:
            self.announce(version)
        self.publisher.publish(version, named_tensors, snapshot=snapshot)

    def publish_stream(self, version: int, chunks: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """`WeightSender.publish_stream`: each bucket goes on the wire as soon as its chunks are packed
        (`WeightPublisher.publish_stream`)."""
        self.publisher.wait()
        if self.announce is not None:
            self.announce(version)
        self.publisher.publish_stream(version, chunks)

    def wait_packed(self) -> None:
        self.publisher.wait_packed()

    def wait(self) -> None:
        self.publisher.wait()

    @property
    def in_flight(self) -> bool:
        return self.publisher.in_flight


class GroupWeightReceiver:
    """`WeightSource` over a `StandaloneGroup` (`WeightReceiver`: views into its own buckets)."""

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver

    @classmethod
    def open(cls, group: StandaloneGroup, src_member: int = 0) -> GroupWeightReceiver:
        """Collective with the sender's `GroupWeightSender.open`: receive the bucket layout."""
        return cls(WeightReceiver(group, src_member))

    def receive(
        self, on_bucket: BucketConsumer | None = None, into: Mapping[str, torch.Tensor] | None = None
    ) -> Received:
        """`WeightSource.receive`; `on_bucket` sees each bucket's named views as soon as it lands, while
        the next buckets are still on the wire; `into` lands lone buckets straight in the caller's
        tensors (see `WeightReceiver.receive`)."""
        return self.receiver.receive(on_bucket, into)


# ----- in one process: threads and queues (tests, fakes) -----
class InProcessWeightTransport:
    """One sender and `num_receivers` receivers in one process; every wait bounded by `timeout_s`."""

    def __init__(self, num_receivers: int = 1, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.queues: list[queue.Queue[tuple[int, list[tuple[str, torch.Tensor]], threading.Event]]] = [
            queue.Queue() for _ in range(num_receivers)
        ]

    def sender(self, announce: Announce | None = None) -> InProcessWeightSender:
        return InProcessWeightSender(self, announce)

    def receiver(self, index: int = 0) -> InProcessWeightReceiver:
        return InProcessWeightReceiver(self, index)


class InProcessWeightSender:
    """`WeightSender`: snapshots by cloning; a background thread waits for every receiver's delivery."""

    def __init__(self, transport: InProcessWeightTransport, announce: Announce | None = None) -> None:
        self.transport = transport
        self.announce = announce
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    def publish(self, version: int, named_tensors: NamedTensors, *, snapshot: bool = True) -> None:
        self.wait()
        if self.announce is not None:
            self.announce(version)
        named = _named_dict(named_tensors).items()
        copies = [(name, t.detach().clone() if snapshot else t.detach()) for name, t in named]
        acks = [threading.Event() for _ in self.transport.queues]
        for q, ack in zip(self.transport.queues, acks, strict=True):
            q.put((int(version), copies, ack))
        self._thread = threading.Thread(
            target=self._finish, args=(version, acks), name=f"weights-v{version}", daemon=True
        )
        self._thread.start()

    def publish_stream(self, version: int, chunks: Iterable[Mapping[str, torch.Tensor]]) -> None:
        self.publish(version, {name: t for chunk in chunks for name, t in chunk.items()}, snapshot=True)

    def _finish(self, version: int, acks: list[threading.Event]) -> None:
        deadline = time.monotonic() + self.transport.timeout_s
        missing = [i for i, ack in enumerate(acks) if not ack.wait(max(0.0, deadline - time.monotonic()))]
        if missing:
            self._error = PeerTimeoutError(
                f"weights v{version} not received within {self.transport.timeout_s:g}s by receivers {missing}"
            )

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class InProcessWeightReceiver:
    """`WeightSource`: the sender's snapshot (shared by all receivers: read it, do not modify it)."""

    def __init__(self, transport: InProcessWeightTransport, index: int) -> None:
        self.transport = transport
        self.index = index

    def receive(self) -> Received:
        try:
            version, named, ack = self.transport.queues[self.index].get(timeout=self.transport.timeout_s)
        except queue.Empty:
            raise PeerTimeoutError(
                f"receiver {self.index}: no weights delivered within {self.transport.timeout_s:g}s"
            ) from None
        ack.set()
        return version, list(named)
