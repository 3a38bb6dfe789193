"""Flat byte buckets for named tensors: a static layout computed once, pack into buckets, unpack as views.

A `BucketLayout` lists every tensor (HF name, shape, dtype) with its bucket index and byte offset. It is
computed once from the publisher's parameters (`plan_layout`) and shared with the receivers at start
(`BucketLayout.to_bytes/from_bytes`), so each version moves as a few large byte buffers and no
per-parameter message. Invariants:
- tensors are placed greedily in the given order; a bucket never exceeds `bucket_bytes`, except a
  tensor larger than a bucket, which gets a bucket of its own;
- with `direct_bytes`, every tensor of at least that many bytes gets a bucket of its own too (a "lone"
  bucket, `lone_slot`), and the smaller ones keep filling the open shared bucket around it: a lone
  bucket can go on the wire straight from the sender's tensor and land straight in the receiver's
  (`WeightReceiver.receive(into=...)`), so large weights cost no copy on either side;
- every offset and every bucket size is a multiple of `ALIGN` bytes, so a slice of a uint8 bucket can be
  viewed as any dtype;
- `unpack` returns views into the bucket buffers: they stay valid until the buffers are written again.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

ALIGN = 64
CHECKSUM_CHUNK_WORDS = 1 << 24


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives: bucket index and byte offset inside that bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketLayout:
    """The static placement of every named tensor into flat uint8 buckets."""

    slots: tuple[TensorSlot, ...]
    bucket_nbytes: tuple[int, ...]

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_nbytes)

    @property
    def total_nbytes(self) -> int:
        return sum(self.bucket_nbytes)

    def to_bytes(self) -> bytes:
        slots = [[s.name, list(s.shape), s.dtype, s.bucket, s.offset, s.nbytes] for s in self.slots]
        return json.dumps({"slots": slots, "buckets": list(self.bucket_nbytes)}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> BucketLayout:
        obj = json.loads(data)
        slots = tuple(TensorSlot(n, tuple(sh), dt, b, o, nb) for n, sh, dt, b, o, nb in obj["slots"])
        return cls(slots, tuple(obj["buckets"]))

    def fingerprint(self) -> int:
        """A 62-bit digest of the layout; both sides compare it in every version header."""
        return int.from_bytes(hashlib.sha256(self.to_bytes()).digest()[:8], "little") >> 2


TensorSpec = tuple[str, Sequence[int], torch.dtype]


def plan_layout(
    specs: Iterable[TensorSpec], bucket_bytes: int, direct_bytes: int | None = None
) -> BucketLayout:
    """Place tensors greedily, in order, into buckets of at most `bucket_bytes`; with `direct_bytes`,
    tensors of at least that size each get a bucket of their own (see module invariants)."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket size must be at least {ALIGN} bytes, got {bucket_bytes}")
    if direct_bytes is not None and direct_bytes < ALIGN:
        raise ValueError(f"direct-send size must be at least {ALIGN} bytes, got {direct_bytes}")
    slots: list[TensorSlot] = []
    sizes: list[int] = []
    names: set[str] = set()
    shared, used = -1, bucket_bytes + 1  # the open shared bucket; the first small tensor opens one
    for name, shape, dtype in specs:
        if name in names:
            raise ValueError(f"tensor name {name!r} appears twice")
        names.add(name)
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * dtype.itemsize
        shape_ = tuple(int(d) for d in shape)
        if direct_bytes is not None and nbytes >= direct_bytes:
            slots.append(TensorSlot(name, shape_, dtype_name(dtype), len(sizes), 0, nbytes))
            sizes.append(_align(nbytes))
            continue
        if used + _align(nbytes) > bucket_bytes:
            shared, used = len(sizes), 0
            sizes.append(0)
        slots.append(TensorSlot(name, shape_, dtype_name(dtype), shared, used, nbytes))
        used += _align(nbytes)
        sizes[shared] = used
    return BucketLayout(tuple(slots), tuple(max(s, ALIGN) for s in sizes))


def layout_for(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, direct_bytes: int | None = None
) -> BucketLayout:
    """`plan_layout` from named tensors (their shapes and dtypes; contents are not read)."""
    return plan_layout(((n, tuple(t.shape), t.dtype) for n, t in named), bucket_bytes, direct_bytes)


def allocate_buckets(layout: BucketLayout, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    return [torch.empty(n, dtype=torch.uint8, device=device) for n in layout.bucket_nbytes]


def slot_view(slot: TensorSlot, buckets: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensor of `slot` as a typed view into its bucket."""
    raw = buckets[slot.bucket][slot.offset : slot.offset + slot.nbytes]
    return raw.view(dtype_from_name(slot.dtype)).view(slot.shape)


def check_matches(layout: BucketLayout, named: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError unless `named` has exactly the layout's names, shapes and dtypes."""
    expected = {s.name for s in layout.slots}
    if set(named) != expected:
        extra = sorted(set(named) - expected)[:3]
        missing = sorted(expected - set(named))[:3]
        raise ValueError(f"tensors do not match the layout: unexpected {extra}, missing {missing}")
    for slot in layout.slots:
        tensor = named[slot.name]
        if tuple(tensor.shape) != slot.shape or dtype_name(tensor.dtype) != slot.dtype:
            raise ValueError(
                f"{slot.name}: got {tuple(tensor.shape)} {dtype_name(tensor.dtype)}, "
                f"layout has {slot.shape} {slot.dtype}"
            )


def pack_bucket(
    layout: BucketLayout, index: int, named: Mapping[str, torch.Tensor], buckets: Sequence[torch.Tensor]
) -> None:
    """Copy every tensor that belongs to bucket `index` into its slot."""
    for slot in layout.slots:
        if slot.bucket == index and slot.nbytes:
            slot_view(slot, buckets).copy_(named[slot.name].detach())


def pack(layout: BucketLayout, named: Mapping[str, torch.Tensor], buckets: Sequence[torch.Tensor]) -> None:
    check_matches(layout, named)
    for index in range(layout.num_buckets):
        pack_bucket(layout, index, named, buckets)


def unpack(layout: BucketLayout, buckets: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Named typed views into `buckets`, in layout order (no copy)."""
    return [(slot.name, slot_view(slot, buckets)) for slot in layout.slots]


def bucket_views(
    layout: BucketLayout, buckets: Sequence[torch.Tensor]
) -> list[list[tuple[str, torch.Tensor]]]:
    """Per bucket, the named typed views of its tensors, in layout order (no copy)."""
    per_bucket: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(layout.num_buckets)]
    for slot in layout.slots:
        per_bucket[slot.bucket].append((slot.name, slot_view(slot, buckets)))
    return per_bucket


def lone_slot(layout: BucketLayout, index: int) -> TensorSlot | None:
    """The slot that is alone in bucket `index` (one non-empty tensor at offset 0), or None. Such a
    bucket goes on the wire as exactly the tensor's bytes (its alignment padding is never sent), so it
    can be sent straight from the sender's tensor and land straight in the receiver's."""
    found = [slot for slot in layout.slots if slot.bucket == index]
    if len(found) == 1 and found[0].offset == 0 and found[0].nbytes > 0:
        return found[0]
    return None


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """A flat uint8 view of a contiguous tensor's bytes (no copy), or None when it is not contiguous."""
    if not tensor.is_contiguous():
        return None
    return tensor.detach().reshape(-1).view(torch.uint8)


def bucket_checksum(bucket: torch.Tensor) -> int:
    """CRC32 of the bytes of a CPU bucket; on GPU `weighted_word_sum` (no copy to the host)."""
    if bucket.device.type == "cpu":
        return zlib.crc32(bucket.numpy().data)
    return weighted_word_sum(bucket)


def weighted_word_sum(bucket: torch.Tensor) -> int:
    """A position-weighted sum of a uint8 tensor's 64-bit words (and of its trailing bytes: a lone bucket
    is the tensor's own bytes, of any length and offset), computed on the tensor's device."""
    if bucket.storage_offset() % 8:
        bucket = bucket.clone()  # a view at an unaligned offset cannot be read as 64-bit words
    whole = bucket.numel() // 8 * 8
    words = bucket[:whole].view(torch.int64)
    tail = torch.arange(bucket.numel() - whole, dtype=torch.int64, device=bucket.device) + 3
    total = (bucket[whole:].to(torch.int64) * tail).sum()
    for start in range(0, words.numel(), CHECKSUM_CHUNK_WORDS):
        chunk = words[start : start + CHECKSUM_CHUNK_WORDS]
        weights = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=bucket.device)
        total += (chunk * weights).sum() + chunk.sum()
    return int(total.item()) & ((1 << 62) - 1)
