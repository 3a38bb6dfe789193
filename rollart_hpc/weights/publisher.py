"""Asynchronous bucketed weight broadcast: one publisher (a trainer rank), many receivers (rollout ranks).

Dataflow of one version (round r, counted from 1 on every member):
1. publisher: `publish(version, named)` waits for round r-1 to finish (one version in flight), marks its
   arrival, issues the header broadcast (magic, version, number of buckets, layout fingerprint, checksum
   flag), then packs bucket by bucket, issuing each bucket's broadcast as soon as it is packed (assembly
   overlaps the wire). The sender's buffers are bounded: at most `depth` (default 2) bucket broadcasts are
   in flight, each shared bucket packed into one of a ring of `depth` send buffers (as large as the
   largest shared bucket, at most the layout's `bucket_bytes`; allocated on first use, reused by every
   version), so packing bucket i+depth first waits for bucket i's broadcast to end. A lone bucket (one
   contiguous tensor alone: a tensor larger than a bucket, or one of at least `direct_bytes`:
   `buckets.lone_slot`) is broadcast straight from the caller's tensor where the sender may (below) and
   else from a transient copy of that one tensor, freed when its broadcast ends. So the sender never holds
   more than `depth` x max(bucket_bytes, largest tensor) of buffers (`peak_bytes`), never the model.
   `publish` returns once every bucket is packed, that is once all but the last `depth` buckets are
   delivered: that is the snapshot, so the caller may change its tensors at once (on GPU the copies are
   queued on the current stream, which the NCCL broadcasts wait for). A background thread waits for the
   remaining broadcasts with the group timeout, then (when enabled) broadcasts the per-bucket checksums
   (each computed as its bucket was issued). With `snapshot=False` the round's start (arrival mark, header)
   and the packing move into that thread too and `publish` returns at once; lone buckets are then sent
   from the caller's tensors (on the group's device), so the large tensors cost no copy on the sending
   side. The caller must not change its tensors until `wait_packed()` returns (e.g. it runs its next
   forward and backward meanwhile and waits before the optimizer step); with direct sends that is when
   their broadcasts have ended. `publish_stream(version, chunks)` takes the tensors as a sequence of chunks
   instead (a model-parallel trainer gathers one unit at a time, so no rank holds the whole model twice):
   it keeps each chunk's tensors until their bucket and every bucket before it are complete, then packs
   and issues that bucket (a lone one straight from its tensor); it returns once the last chunk is packed
   and every direct send has ended (a snapshot, as above).
2. receiver: `receive(on_bucket, into)` marks its arrival, takes part in the header broadcast, checks the
   header against its layout, then keeps at most `depth` (default 2) bucket broadcasts in flight, each
   landing in one of a ring of `depth` receive buffers (allocated on first use, as large as the largest
   bucket that lands in one, reused by every version): as soon as bucket i has landed it calls
   `on_bucket` with that bucket's named views while bucket i+1 is on the wire, then issues bucket
   i+depth into the freed buffer. So the receiver never holds more than the buckets in flight, and the
   consumer must copy each bucket out during its call (the rollout rank lands it in its engine's
   staging: `Engine.begin_weights`); `receive` returns the version. With checksums enabled each bucket's
   checksum is computed as it lands and compared once the publisher's arrive after the last bucket: what
   `on_bucket` saw is valid only once `receive()` returns without raising. `into=staged` lands every lone
   bucket (one tensor, `buckets.lone_slot`, e.g. a layout planned with `direct_bytes`) whose name is in
   `staged` straight in that tensor (contiguous, same shape, dtype and device; checked before any
   broadcast, a mismatch is a ValueError; `landable` picks the entries that qualify): no ring buffer and
   no copy. `on_bucket` then sees only the buckets that still need copying. The caller must not read
   those tensors (no forward on them) until `receive()` returns: they are the staging half of a
   double-buffered consumer.

Who waits on whom: every wait on a broadcast is bounded by the group timeout and names the peers on
timeout (`StandaloneGroup.wait`); packing waits for a send buffer to come free, so `publish`,
`publish_stream` and `wait_packed` wait (bounded) on the receivers of the buckets `depth` back. If `on_bucket` raises, the
receiver still takes part (bounded) in the remaining broadcasts of the version (buckets, checksums), then
re-raises, so no broadcast of that version is left writing into its buffers and the stream stays aligned.

Errors: a publisher-side failure (timeout naming the silent receiver, checksum broadcast) is raised by
`publish`/`publish_stream` while they pack, or kept by the background thread and raised by the next
`publish()`, `wait()` or `wait_packed()`. After any error the group is broken.

The notification ("version n is coming"): a publisher built with `announce` calls it with each version
after the previous version was delivered and before the new one's header (in a run, a WEIGHTS message
to every rollout rank: `transport.announce_to`), so an announcement of v precedes the delivery of v. Publisher and
receivers must be built in the same order on every member (both constructors are collective: they share
the layout).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from rollart_hpc.weights.buckets import (
    BucketLayout,
    TensorSlot,
    bucket_checksum,
    check_matches,
    dtype_name,
    lone_slot,
    slot_view,
    tensor_bytes,
)
from rollart_hpc.weights.group import StandaloneGroup

MAGIC = 0x5EED_B0C7
HEADER_LEN = 5
BucketConsumer = Callable[[list[tuple[str, torch.Tensor]]], None]
Announce = Callable[[int], None]


class WeightSyncError(RuntimeError):
    """The weight stream is inconsistent (header, layout or checksum mismatch)."""


def share_layout(group: StandaloneGroup, layout: BucketLayout | None, src_member: int) -> BucketLayout:
    """Collective: the source sends its layout (length, then JSON bytes); every member returns it."""
    data = layout.to_bytes() if layout is not None else b""
    length = torch.tensor([len(data)], dtype=torch.int64)
    group.broadcast(length, src_member, "weight layout size")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    if group.member != src_member:
        buf = torch.empty(int(length.item()), dtype=torch.uint8)
    group.broadcast(buf, src_member, "weight layout")
    return layout if layout is not None else BucketLayout.from_bytes(buf.numpy().tobytes())


def _device_for(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class _Flight(NamedTuple):
    """A bucket broadcast in flight: its work, its description, the ring buffer it holds (or None), the
    transient copy of a lone bucket it holds (or None), whether it reads a caller's tensor directly."""

    work: Any
    what: str
    ring: int | None
    copy: torch.Tensor | None
    direct: bool


class WeightPublisher:
    """The sending side; see the module docstring for the protocol, the snapshot rule and the bound on
    its buffers (`depth` bucket broadcasts in flight at most)."""

    def __init__(
        self,
        group: StandaloneGroup,
        layout: BucketLayout,
        checksum: bool = False,
        announce: Announce | None = None,
        depth: int = 2,
    ) -> None:
        if depth < 1:
            raise ValueError(f"send depth must be at least 1, got {depth}")
        self.group = group
        self.announce = announce
        self.layout = share_layout(group, layout, group.member)
        self.checksum = checksum
        self.depth = depth
        self.device = _device_for(group.backend)
        self._lone = [lone_slot(self.layout, index) for index in range(self.layout.num_buckets)]
        self._slots: list[list[TensorSlot]] = [[] for _ in range(self.layout.num_buckets)]
        for slot in self.layout.slots:
            self._slots[slot.bucket].append(dataclasses.replace(slot, bucket=0))
        # The send ring: `depth` buffers as large as the largest shared bucket, allocated on first use and
        # reused by every version. A lone bucket is sent from the caller's tensor where it can be, else
        # from a transient copy of that one tensor, freed once its broadcast has ended.
        self._ring_nbytes = max(
            (n for n, lone in zip(self.layout.bucket_nbytes, self._lone, strict=True) if lone is None),
            default=0,
        )
        self._ring: list[torch.Tensor | None] = [None] * depth
        self._free = list(range(depth))
        self._flights: deque[_Flight] = deque()
        self._copy_bytes = 0
        self.peak_bytes = 0  # the most send-buffer bytes (ring and transient copies) held at once
        self._sums: list[int] = []
        self.direct_sends = 0  # buckets sent straight from a caller's tensor, over all versions
        self.round = 0
        self._header_work: tuple[Any, str] | None = None
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None
        self._packed = threading.Event()
        self._packed.set()

    @property
    def allocated_bytes(self) -> int:
        """The send-buffer bytes held now: the ring's buffers and the transient lone-bucket copies."""
        return sum(b.numel() for b in self._ring if b is not None) + self._copy_bytes

    def publish(
        self,
        version: int,
        named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        snapshot: bool = True,
    ) -> None:
        """Start broadcasting `named` as `version` (see the module docstring).

        `snapshot=True`: returns once every bucket is packed (the caller may change its tensors at once),
        that is once all but the last `depth` buckets are delivered. `snapshot=False`: returns at once;
        the round's start (arrival mark, header) and the packing run in the background thread; the caller
        leaves its tensors unchanged until `wait_packed()` (or `wait()`) returns."""
        self.wait()
        if self.announce is not None:
            self.announce(version)
        tensors = dict(named.items() if isinstance(named, Mapping) else named)
        check_matches(self.layout, tensors)
        self._packed.clear()
        if snapshot:
            try:
                self._start_round(version)
                for index in range(self.layout.num_buckets):
                    self._issue(version, index, tensors, direct=False)
            except BaseException:
                self._abandon()
                raise
            finally:
                self._packed.set()
        pending = None if snapshot else tensors
        self._thread = threading.Thread(
            target=self._finish, args=(version, pending), name=f"weights-v{version}", daemon=True
        )
        self._thread.start()

    def publish_stream(self, version: int, chunks: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Start broadcasting `version` from `chunks` of named tensors (together exactly the layout's names,
        in any order); see the module docstring. Returns once every chunk is packed or sent."""
        self.wait()
        if self.announce is not None:
            self.announce(version)
        self._start_round(version)
        missing = [len(slots) for slots in self._slots]
        slots = {entry.name: entry for entry in self.layout.slots}
        pending: dict[str, torch.Tensor] = {}  # the caller's tensors of buckets not yet complete
        seen: set[str] = set()
        issued = 0
        try:
            for chunk in chunks:
                for name, tensor in chunk.items():
                    place = slots.get(name)
                    if place is None or name in seen:
                        raise WeightSyncError(
                            f"weights v{version}: {name!r} is not in the layout or comes twice"
                        )
                    if tuple(tensor.shape) != place.shape or dtype_name(tensor.dtype) != place.dtype:
                        raise WeightSyncError(
                            f"weights v{version}: {name} is {tuple(tensor.shape)} {dtype_name(tensor.dtype)}, "
                            f"the layout has {place.shape} {place.dtype}"
                        )
                    pending[name] = tensor
                    seen.add(name)
                    missing[place.bucket] -= 1
                while issued < self.layout.num_buckets and missing[issued] == 0:
                    self._issue(version, issued, pending, direct=True)
                    for slot in self._slots[issued]:
                        del pending[slot.name]
                    issued += 1
            if issued < self.layout.num_buckets:
                absent = sorted(set(slots) - seen)[:3]
                raise WeightSyncError(f"weights v{version}: the chunks left out {absent}")
            while any(flight.direct for flight in self._flights):  # a snapshot: the caller's tensors are free
                self._retire()
        except BaseException:
            self._abandon()
            raise
        finally:
            self._packed.set()
        self._thread = threading.Thread(
            target=self._finish, args=(version, None), name=f"weights-v{version}", daemon=True
        )
        self._thread.start()

    def _start_round(self, version: int) -> None:
        """Begin a version: the next round, its arrival mark, the header broadcast; packing starts."""
        self.round += 1
        self.group.mark_arrival(self.round)
        header = torch.tensor(
            [MAGIC, version, self.layout.num_buckets, self.layout.fingerprint(), int(self.checksum)],
            dtype=torch.int64,
            device=self.device,
        )
        self._packed.clear()
        self._sums = []
        self._header = header  # alive until its broadcast ends
        self._header_work = (
            self.group.start_broadcast(header, self.group.member),
            f"weights v{version} header",
        )

    def _wait_header(self) -> None:
        if self._header_work is not None:
            (work, what), self._header_work = self._header_work, None
            self.group.wait(work, self.group.member, what, self.round)

    def _retire(self) -> None:
        """Wait for the oldest bucket broadcast in flight (the header first) and release what it held."""
        self._wait_header()
        flight = self._flights.popleft()
        self.group.wait(flight.work, self.group.member, flight.what, self.round)
        if flight.ring is not None:
            self._free.append(flight.ring)
        if flight.copy is not None:
            self._copy_bytes -= flight.copy.numel()

    def _abandon(self) -> None:
        """Forget the broadcasts of a failed round (the group is broken; see the module docstring)."""
        self._flights.clear()
        self._header_work = None
        self._free = list(range(self.depth))
        self._copy_bytes = 0

    def _hold(self, nbytes: int) -> torch.Tensor:
        """A transient copy buffer for one lone bucket, counted until its broadcast ends."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._copy_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return buffer

    def _ring_buffer(self, index: int) -> torch.Tensor:
        buffer = self._ring[index]
        if buffer is None:
            buffer = self._ring[index] = torch.empty(self._ring_nbytes, dtype=torch.uint8, device=self.device)
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return buffer

    def _issue(self, version: int, index: int, tensors: Mapping[str, torch.Tensor], direct: bool) -> bool:
        """Issue bucket `index`'s broadcast once fewer than `depth` are in flight: packed from `tensors`
        into a free ring buffer, or, for a lone bucket, sent straight from its tensor (`direct`, on the
        group's device and contiguous) or from a transient copy. Returns whether it was sent directly."""
        while len(self._flights) >= self.depth:
            self._retire()
        lone = self._lone[index]
        ring, copy, wire = None, None, None
        if lone is not None and direct and tensors[lone.name].device == self.device:
            wire = tensor_bytes(tensors[lone.name])
        if wire is not None:
            self.direct_sends += 1
        elif lone is not None:
            wire = copy = self._hold(lone.nbytes)
            slot_view(self._slots[index][0], [copy]).copy_(tensors[lone.name].detach())
        else:
            ring = self._free.pop(0)
            buffer = self._ring_buffer(ring)
            for slot in self._slots[index]:
                if slot.nbytes:
                    slot_view(slot, [buffer]).copy_(tensors[slot.name].detach())
            wire = buffer[: self.layout.bucket_nbytes[index]]
        if self.checksum:
            self._sums.append(bucket_checksum(wire))
        what = f"weights v{version} bucket {index}/{self.layout.num_buckets}"
        is_direct = ring is None and copy is None
        self._flights.append(
            _Flight(self.group.start_broadcast(wire, self.group.member), what, ring, copy, is_direct)
        )
        return is_direct

    def _finish(self, version: int, pending: Mapping[str, torch.Tensor] | None) -> None:
        try:
            if pending is not None:  # deferred: the round starts and is packed here, off the caller's thread
                self._start_round(version)
                any_direct = False
                for index in range(self.layout.num_buckets):
                    any_direct |= self._issue(version, index, pending, direct=True)
                if not any_direct:
                    self._packed.set()
            self._wait_header()
            while self._flights:
                self._retire()
            self._packed.set()
            if self.checksum:
                sums = torch.tensor(self._sums, dtype=torch.int64)
                self.group.broadcast(sums.to(self.device), self.group.member, f"weights v{version} checksums")
        except Exception as exc:  # not swallowed: re-raised in the caller's thread by wait()/publish()
            self._error = exc
            self._abandon()
        finally:
            self._packed.set()

    def wait_packed(self) -> None:
        """Block until the version in flight is packed into the send buckets (its tensors may change);
        packing is local work, so this wait needs no peer. Re-raises a background failure."""
        self._packed.wait()
        if self._error is not None:
            self.wait()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the version in flight is delivered; re-raise the background thread's error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class WeightReceiver:
    """The receiving side: takes part in the publisher's broadcasts through a ring of `depth` receive
    buffers (each as large as the largest bucket that lands in one), so it never holds more than the
    buckets in flight."""

    def __init__(self, group: StandaloneGroup, src_member: int = 0, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"receive depth must be at least 1, got {depth}")
        self.group = group
        self.src = src_member
        self.depth = depth
        self.layout = share_layout(group, None, src_member)
        self.device = _device_for(group.backend)
        self._lone = [lone_slot(self.layout, index) for index in range(self.layout.num_buckets)]
        self._slots: list[list[TensorSlot]] = [[] for _ in range(self.layout.num_buckets)]
        for slot in self.layout.slots:
            self._slots[slot.bucket].append(slot)
        self.ring: list[torch.Tensor] = []  # allocated on first use, grown only when a bucket needs it
        self.round = 0

    @property
    def allocated_bytes(self) -> int:
        """The bytes of the receive buffers this receiver holds (the ring)."""
        return sum(buffer.numel() for buffer in self.ring)

    def landable(self, into: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of `into` that a bucket can land in directly: a lone bucket's tensor of the same
        shape, dtype and device, contiguous."""
        lone = {slot.name: slot for slot in self._lone if slot is not None}
        return {
            name: tensor
            for name, tensor in into.items()
            if name in lone
            and tensor_bytes(tensor) is not None
            and tuple(tensor.shape) == lone[name].shape
            and dtype_name(tensor.dtype) == lone[name].dtype
            and tensor.device == self.device
        }

    def receive(
        self, on_bucket: BucketConsumer | None = None, into: Mapping[str, torch.Tensor] | None = None
    ) -> int:
        """Take part in one version's broadcasts; returns the version.

        `on_bucket(named)` is called with each bucket's named views as soon as that bucket has landed,
        while the next bucket is on the wire; the views are valid only during the call (their ring
        buffer takes a later bucket). `into` lands lone buckets straight in the caller's tensors (see
        the module docstring)."""
        targets = self._targets(into or {})  # before any broadcast: a bad `into` leaves the stream intact
        self._grow_ring(targets)
        self.round += 1
        self.group.mark_arrival(self.round)
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        self.group.broadcast(header, self.src, "weights header")
        version = self._check_header(header.tolist())
        sums, error = self._receive_buckets(version, on_bucket, targets, bool(header[4].item()))
        if sums is not None:
            self._verify_checksums(version, sums)
        if error is not None:  # raised once every broadcast of this version, checksums included, is done
            raise error
        return version

    def _grow_ring(self, targets: list[torch.Tensor | None]) -> None:
        need = max(
            (n for n, t in zip(self.layout.bucket_nbytes, targets, strict=True) if t is None), default=0
        )
        if need and (len(self.ring) < self.depth or self.ring[0].numel() < need):
            self.ring = [torch.empty(need, dtype=torch.uint8, device=self.device) for _ in range(self.depth)]

    def _wire(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        """What bucket `index`'s broadcast lands in: a ring buffer's first bytes (only the tensor's bytes
        for a lone bucket)."""
        lone = self._lone[index]
        return buffer[: self.layout.bucket_nbytes[index] if lone is None else lone.nbytes]

    def _views(self, index: int, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The named typed views of bucket `index` landed in `buffer`."""
        return [(s.name, slot_view(dataclasses.replace(s, bucket=0), [buffer])) for s in self._slots[index]]

    def _targets(self, into: Mapping[str, torch.Tensor]) -> list[torch.Tensor | None]:
        """Per bucket, the caller's tensor's bytes it lands in (a lone bucket named in `into`), or None."""
        targets: list[torch.Tensor | None] = []
        for index in range(self.layout.num_buckets):
            slot = self._lone[index]
            tensor = into.get(slot.name) if slot is not None else None
            if tensor is None or slot is None:
                targets.append(None)
                continue
            wire = tensor_bytes(tensor)
            if (
                wire is None
                or tuple(tensor.shape) != slot.shape
                or dtype_name(tensor.dtype) != slot.dtype
                or tensor.device != self.device
            ):
                raise ValueError(
                    f"receive into {slot.name}: need a contiguous {slot.shape} {slot.dtype} tensor on "
                    f"{self.device}, got {tuple(tensor.shape)} {dtype_name(tensor.dtype)} on {tensor.device}"
                    + ("" if wire is not None else " (not contiguous)")
                )
            targets.append(wire)
        return targets

    def _receive_buckets(
        self,
        version: int,
        on_bucket: BucketConsumer | None,
        targets: list[torch.Tensor | None],
        checksum: bool,
    ) -> tuple[list[int] | None, Exception | None]:
        """At most `depth` bucket broadcasts in flight; each bucket not landed in place goes to a ring
        buffer and to `on_bucket` as it lands, and its buffer then takes the next bucket. Returns each
        bucket's checksum (computed as it lands, when enabled) and the consumer's error, if any, after
        every bucket broadcast has completed (bounded waits)."""
        count = self.layout.num_buckets
        wires: list[torch.Tensor] = []
        works: list[Any] = []
        free = list(range(len(self.ring)))
        owner: list[int | None] = []

        def issue(index: int) -> None:
            target = targets[index]
            if target is None:
                ring_index = free.pop(0)
                owner.append(ring_index)
                target = self._wire(index, self.ring[ring_index])
            else:
                owner.append(None)
            wires.append(target)
            works.append(self.group.start_broadcast(target, self.src))

        sums: list[int] | None = [] if checksum else None
        error: Exception | None = None
        for index in range(min(self.depth, count)):
            issue(index)
        for index in range(count):
            self.group.wait(works[index], self.src, f"weights v{version} bucket {index}/{count}")
            if sums is not None:
                sums.append(bucket_checksum(wires[index]))
            ring_index = owner[index]
            if ring_index is not None:
                if on_bucket is not None and error is None:
                    try:
                        on_bucket(self._views(index, self.ring[ring_index]))
                    except Exception as exc:  # raised by receive() once the wire is drained
                        error = exc
                free.append(ring_index)
            if index + self.depth < count:
                issue(index + self.depth)
        return sums, error

    def _check_header(self, header: list[int]) -> int:
        magic, version, num_buckets, fingerprint, _ = header
        if magic != MAGIC:
            raise WeightSyncError(f"{self.group.world.me}: bad weight header magic {magic:#x}")
        if num_buckets != self.layout.num_buckets or fingerprint != self.layout.fingerprint():
            raise WeightSyncError(
                f"{self.group.world.me}: weights v{version} use another layout "
                f"({num_buckets} buckets, fingerprint {fingerprint:#x})"
            )
        return int(version)

    def _verify_checksums(self, version: int, landed: list[int]) -> None:
        sums = torch.zeros(self.layout.num_buckets, dtype=torch.int64, device=self.device)
        self.group.broadcast(sums, self.src, f"weights v{version} checksums")
        for index, (expected, got) in enumerate(zip(sums.tolist(), landed, strict=True)):
            if got != expected:
                raise WeightSyncError(
                    f"{self.group.world.me}: weights v{version} bucket {index} checksum mismatch"
                )
