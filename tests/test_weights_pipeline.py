"""Publisher and receiver over recording fake groups (single process): the order of issue, landing and
consumption of the bucket broadcasts, and the deferred packing of `publish(snapshot=False)`.

The real multi-process version is tests/test_weights_pipeline_mpi.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollart_hpc.weights.buckets import layout_for, lone_slot
from rollart_hpc.weights.publisher import WeightPublisher, WeightReceiver

BUCKET_BYTES = 4096


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [((100, 7), torch.float32), ((333,), torch.bfloat16), ((1500,), torch.float32),
              ((41, 9), torch.float32), ((2048,), torch.bfloat16), ((129,), torch.bfloat16)]  # fmt: skip
    return {f"w{i}": torch.randn(s, generator=g).to(dt) for i, (s, dt) in enumerate(shapes)}


class _Work:
    def __init__(self, on_wait: Any) -> None:
        self.on_wait = on_wait

    def wait(self) -> None:
        self.on_wait()


class _FakeGroup:
    """The `StandaloneGroup` surface the publisher and receiver use. As the source it records a clone of
    every broadcast tensor when its work is waited; as a receiver it replays `payloads` in issue order."""

    backend = "gloo"

    def __init__(self, member: int, payloads: list[torch.Tensor] | None = None) -> None:
        self.member, self.payloads = member, payloads
        self.gate: threading.Event | None = None
        self.sent: list[torch.Tensor] = []
        self.events: list[tuple[str, int]] = []
        self.issued = 0
        self.in_flight = self.max_in_flight = 0
        self.world = SimpleNamespace(me=f"member {member}")

    def start_broadcast(self, tensor: torch.Tensor, src_member: int) -> _Work:
        index, self.issued = self.issued, self.issued + 1
        self.events.append(("issue", index))
        if self.gate is not None and index == 1:
            assert self.gate.wait(10), "the gate was never opened"
        if self.member == src_member:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return _Work(lambda: (self.sent.append(tensor.clone()), self._landed()))
        assert self.payloads is not None
        return _Work(lambda: (tensor.copy_(self.payloads[index]), self.events.append(("land", index))))

    def _landed(self) -> None:
        self.in_flight -= 1

    def wait(self, work: _Work, src_member: int, what: str, round_id: int | None = None) -> None:
        work.wait()

    def broadcast(self, tensor: torch.Tensor, src_member: int, what: str = "broadcast") -> None:
        self.wait(self.start_broadcast(tensor, src_member), src_member, what)

    def mark_arrival(self, round_id: int) -> None:
        self.events.append(("arrive", round_id))


def _collect(
    rec: WeightReceiver, into: dict[str, torch.Tensor] | None = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """Receive one version; (version, a copy of every tensor, or the `into` tensor it landed in)."""
    got: dict[str, torch.Tensor] = {}
    version = rec.receive(lambda views: got.update((n, v.clone()) for n, v in views), into=into)
    return version, {n: got[n] if n in got else (into or {})[n] for n in (s.name for s in rec.layout.slots)}


def _publish(named: dict[str, torch.Tensor], snapshot: bool = True, checksum: bool = False) -> _FakeGroup:
    group = _FakeGroup(0)
    pub = WeightPublisher(group, layout_for(named.items(), BUCKET_BYTES), checksum)  # type: ignore[arg-type]
    pub.publish(3, named, snapshot=snapshot)
    pub.wait()
    return group


def test_receiver_consumes_each_bucket_while_the_next_is_on_the_wire_two_in_flight() -> None:
    named = model(1)
    sender = _publish(named)
    group = _FakeGroup(1, sender.sent)
    rec = WeightReceiver(group, 0)  # type: ignore[arg-type]
    num_buckets = rec.layout.num_buckets
    assert num_buckets >= 4
    group.events.clear()
    consumed: dict[str, torch.Tensor] = {}

    def consume(views: list[tuple[str, torch.Tensor]]) -> None:
        group.events.append(("consume", len(consumed)))
        consumed.update((n, v.clone()) for n, v in views)

    version = rec.receive(consume)
    first = 3  # two layout broadcasts, then the header, then one per bucket
    buckets = range(first, first + num_buckets)
    expected = [("arrive", 1), ("issue", 2), ("land", 2), ("issue", first), ("issue", first + 1)]
    for i in buckets:  # bucket i consumed, then its ring buffer takes bucket i + 2
        expected += [("land", i), ("consume", -1)] + (
            [("issue", i + 2)] if i + 2 < first + num_buckets else []
        )
    got = [(kind, -1 if kind == "consume" else i) for kind, i in group.events]
    assert version == 3 and got == expected
    for name, tensor in named.items():
        assert torch.equal(consumed[name].view(torch.uint8), tensor.view(torch.uint8))
    assert list(consumed) == list(named)


def test_receiver_holds_a_ring_of_two_buckets_reused_across_versions() -> None:
    named = model(1)
    sender = _publish(named)
    group = _FakeGroup(1, sender.sent + sender.sent[2:])
    rec = WeightReceiver(group, 0)  # type: ignore[arg-type]
    _, first = _collect(rec)
    pointers = [b.data_ptr() for b in rec.ring]
    _, second = _collect(rec)
    assert [b.data_ptr() for b in rec.ring] == pointers
    assert rec.allocated_bytes == 2 * max(rec.layout.bucket_nbytes) < rec.layout.total_nbytes
    for name, tensor in named.items():
        assert torch.equal(first[name], tensor) and torch.equal(second[name], tensor)


def test_consumer_error_is_raised_after_every_bucket_and_the_checksums_landed() -> None:
    sender = _publish(model(1), checksum=True)
    group = _FakeGroup(1, sender.sent)
    rec = WeightReceiver(group, 0)  # type: ignore[arg-type]
    consumed = []

    def fail(views: list[tuple[str, torch.Tensor]]) -> None:
        consumed.append(views)
        raise ValueError("consumer failed")

    with pytest.raises(ValueError, match="consumer failed"):
        rec.receive(fail)
    assert len(consumed) == 1  # not called again after it raised
    landed = [i for kind, i in group.events if kind == "land"]
    assert landed == list(range(len(sender.sent)))  # layout, header, every bucket, then the checksums
    assert len(sender.sent) == 2 + 1 + rec.layout.num_buckets + 1


def test_deferred_publish_returns_before_packing_and_sends_the_tensors() -> None:
    named = model(2)
    gate = threading.Event()
    group = _FakeGroup(0)
    pub = WeightPublisher(group, layout_for(named.items(), BUCKET_BYTES))  # type: ignore[arg-type]
    group.gate, group.issued = gate, 0  # after the layout: the header is issue 0, the first bucket issue 1
    pub.publish(4, named, snapshot=False)  # would block on the gate if it packed in this thread
    assert pub.in_flight and group.issued <= 2  # the header, perhaps the first bucket held at the gate
    gate.set()
    pub.wait_packed()
    expected = {n: t.clone() for n, t in named.items()}
    for tensor in named.values():
        tensor.fill_(0.0)  # allowed once packed
    pub.wait()
    _, views = _collect(WeightReceiver(_FakeGroup(1, group.sent), 0))  # type: ignore[arg-type]
    for name, view in views.items():
        assert torch.equal(view.view(torch.uint8), expected[name].view(torch.uint8))


DIRECT_BYTES = 1024


def test_receive_into_lands_lone_buckets_in_the_callers_tensors_without_a_bucket() -> None:
    named = model(4)
    layout = layout_for(named.items(), BUCKET_BYTES, DIRECT_BYTES)
    lone = {slot.name for i in range(layout.num_buckets) if (slot := lone_slot(layout, i)) is not None}
    assert lone == {"w0", "w2", "w3", "w4"}  # 2800, 6000, 1476 and 4096 bytes; w1 and w5 share a bucket
    group = _FakeGroup(0)
    pub = WeightPublisher(group, layout)  # type: ignore[arg-type]
    pub.publish(5, {n: t.clone() for n, t in named.items()}, snapshot=False)  # handed over: sent directly
    pub.wait()
    assert pub.direct_sends == len(lone)
    staged = {n: torch.full_like(t, -7) for n, t in named.items()}
    pointers = {n: t.data_ptr() for n, t in staged.items()}
    rec = WeightReceiver(_FakeGroup(1, group.sent), 0)  # type: ignore[arg-type]
    seen: list[str] = []

    def stage(views: list[tuple[str, torch.Tensor]]) -> None:
        for name, view in views:
            seen.append(name)
            staged[name].copy_(view)

    assert rec.landable(staged) == {n: staged[n] for n in lone}
    version = rec.receive(stage, into=staged)
    assert version == 5 and sorted(seen) == sorted(set(named) - lone)
    for name in named:
        assert torch.equal(staged[name].view(torch.uint8), named[name].view(torch.uint8))
    assert {n: t.data_ptr() for n, t in staged.items()} == pointers
    shared = {s.bucket for s in layout.slots if s.name not in lone}
    assert rec.allocated_bytes == 2 * max(layout.bucket_nbytes[i] for i in shared)  # no lone bucket's size


def test_receive_into_a_mismatched_tensor_fails_before_any_broadcast_and_the_stream_survives() -> None:
    named = model(5)
    layout = layout_for(named.items(), BUCKET_BYTES, DIRECT_BYTES)
    group = _FakeGroup(0)
    pub = WeightPublisher(group, layout)  # type: ignore[arg-type]
    pub.publish(6, named)
    pub.wait()
    rec_group = _FakeGroup(1, group.sent)
    rec = WeightReceiver(rec_group, 0)  # type: ignore[arg-type]
    issued = rec_group.issued
    bad = {"w2": torch.zeros(1500, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"receive into w2: need a contiguous \(1500,\) float32 tensor"):
        rec.receive(into=bad)
    strided = {"w2": torch.zeros(3000)[::2]}
    with pytest.raises(ValueError, match="not contiguous"):
        rec.receive(into=strided)
    assert rec_group.issued == issued and rec.round == 0
    version, views = _collect(rec, into={"w2": torch.zeros(1500)})
    assert version == 6
    for name, view in views.items():
        assert torch.equal(view.view(torch.uint8), named[name].view(torch.uint8))


def _small_model(count: int, extra: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(count)
    named = {f"layer.{i}": torch.randn(1000, generator=g) for i in range(count)}  # 4000 bytes each
    if extra:
        named["embed"] = torch.randn(extra, generator=g)
    return named


@pytest.mark.parametrize("mode", ["snapshot", "deferred", "stream"])
def test_sender_holds_at_most_depth_buckets_of_a_model_many_buckets_large(mode: str) -> None:
    """40 tensors of 4000 bytes in 8 KiB buckets (20 buckets, 160 kB): the sender's buffers never exceed
    2 buckets, at most 2 bucket broadcasts (and the header) are in flight, and every byte arrives."""
    bucket_bytes = 8192
    named = _small_model(40)
    group = _FakeGroup(0)
    pub = WeightPublisher(group, layout_for(named.items(), bucket_bytes), checksum=True)  # type: ignore[arg-type]
    assert pub.layout.num_buckets == 20 and pub.layout.total_nbytes > 8 * pub.depth * bucket_bytes
    group.max_in_flight = 0
    for version in (1, 2):
        if mode == "stream":
            pub.publish_stream(version, ({n: t} for n, t in named.items()))
        else:
            pub.publish(version, named, snapshot=mode == "snapshot")
        pub.wait()
        assert pub.peak_bytes <= pub.depth * bucket_bytes
    assert pub.allocated_bytes == pub.peak_bytes == 2 * 2 * 4032  # two buckets of two aligned tensors, kept
    assert group.max_in_flight <= pub.depth + 1
    rec = WeightReceiver(_FakeGroup(1, group.sent), 0)  # type: ignore[arg-type]
    for version in (1, 2):
        got, views = _collect(rec)
        assert got == version and all(torch.equal(views[n], named[n]) for n in named)
    assert rec.allocated_bytes <= rec.depth * bucket_bytes


def test_a_tensor_larger_than_a_bucket_is_sent_from_the_stream_or_from_one_transient_copy() -> None:
    """A 48 kB embedding in 8 KiB buckets: streamed, it goes out straight from the caller's tensor (no
    copy); from a snapshot `publish`, through one copy of that tensor, freed once it is delivered."""
    named = _small_model(8, extra=12000)
    group = _FakeGroup(0)
    pub = WeightPublisher(group, layout_for(named.items(), 8192))  # type: ignore[arg-type]
    pub.publish_stream(1, ({n: t} for n, t in named.items()))
    pub.wait()
    assert pub.direct_sends == 1 and pub.peak_bytes <= 2 * 8192
    pub.publish(2, named)
    pub.wait()
    assert pub.direct_sends == 1 and pub.peak_bytes <= 2 * 8192 + 48000
    assert pub.allocated_bytes <= 2 * 8192  # the copy is gone
    rec = WeightReceiver(_FakeGroup(1, group.sent), 0)  # type: ignore[arg-type]
    for version in (1, 2):
        got, views = _collect(rec)
        assert got == version and all(torch.equal(views[n], named[n]) for n in named)


def test_send_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="send depth must be at least 1, got 0"):
        WeightPublisher(_FakeGroup(0), layout_for(model(1).items(), BUCKET_BYTES), depth=0)  # type: ignore[arg-type]
