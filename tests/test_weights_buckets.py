"""Bucket layout, pack and unpack (single process)."""

import pytest
import torch

from rollart_hpc.weights.buckets import (
    ALIGN,
    BucketLayout,
    allocate_buckets,
    bucket_checksum,
    layout_for,
    pack,
    plan_layout,
    unpack,
)


def named_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(10, 3, generator=g),
        "b.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.big": torch.randn(100, generator=g, dtype=torch.float64),
        "d.ids": torch.randint(-(1 << 50), 1 << 50, (3, 2), generator=g),
        "e.flag": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(2.5),
        "g.empty": torch.empty(0, 4),
        "h.half": torch.randn(7, generator=g).half(),
    }


@pytest.mark.parametrize("bucket_bytes", [64, 128, 512, 1 << 20])
def test_pack_unpack_round_trip_is_bit_exact(bucket_bytes):
    named = named_tensors()
    layout = layout_for(named.items(), bucket_bytes)
    buckets = allocate_buckets(layout)
    pack(layout, named, buckets)
    out = unpack(layout, buckets)
    assert [n for n, _ in out] == list(named)
    for name, tensor in out:
        assert tensor.dtype == named[name].dtype and tensor.shape == named[name].shape
        assert torch.equal(tensor, named[name])


def test_unpack_returns_views_into_the_buckets():
    named = named_tensors()
    layout = layout_for(named.items(), 256)
    buckets = allocate_buckets(layout)
    pack(layout, named, buckets)
    views = dict(unpack(layout, buckets))
    views["a.weight"][0, 0] = 123.0
    assert dict(unpack(layout, buckets))["a.weight"][0, 0].item() == 123.0


def test_layout_respects_bucket_size_and_alignment():
    specs = [(f"t{i}", (i % 20 + 1,), torch.float32) for i in range(40)] + [("huge", (1000,), torch.float32)]
    layout = plan_layout(specs, 512)
    for slot in layout.slots:
        assert slot.offset % ALIGN == 0
        assert slot.offset + slot.nbytes <= layout.bucket_nbytes[slot.bucket]
    assert all(n % ALIGN == 0 for n in layout.bucket_nbytes)
    huge = next(s for s in layout.slots if s.name == "huge")
    assert [s.name for s in layout.slots if s.bucket == huge.bucket] == ["huge"]
    others = {s.bucket for s in layout.slots if s.name != "huge"}
    assert all(layout.bucket_nbytes[b] <= 512 for b in others)
    assert [s.bucket for s in layout.slots] == sorted(s.bucket for s in layout.slots)


def test_layout_serialises_and_fingerprint_changes_with_it():
    layout = layout_for(named_tensors().items(), 128)
    again = BucketLayout.from_bytes(layout.to_bytes())
    assert again == layout and again.fingerprint() == layout.fingerprint()
    other = layout_for(named_tensors().items(), 256)
    assert other.fingerprint() != layout.fingerprint()


def test_pack_rejects_mismatched_tensors():
    named = named_tensors()
    layout = layout_for(named.items(), 128)
    buckets = allocate_buckets(layout)
    with pytest.raises(ValueError, match="missing"):
        pack(layout, {k: v for k, v in named.items() if k != "a.weight"}, buckets)
    with pytest.raises(ValueError, match="a.weight"):
        pack(layout, {**named, "a.weight": torch.zeros(3, 10)}, buckets)
    with pytest.raises(ValueError, match="b.weight"):
        pack(layout, {**named, "b.weight": torch.zeros(5)}, buckets)
    with pytest.raises(ValueError, match="twice"):
        plan_layout([("x", (1,), torch.float32), ("x", (2,), torch.float32)], 128)


def test_checksum_detects_a_flipped_byte():
    bucket = torch.arange(256, dtype=torch.int64).view(torch.uint8).clone()
    before = bucket_checksum(bucket)
    bucket[100] ^= 1
    assert bucket_checksum(bucket) != before
