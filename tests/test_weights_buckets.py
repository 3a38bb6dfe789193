"""Bucket layout, pack and unpack (single process)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart_hpc.weights.buckets import (
    ALIGN,
    BucketLayout,
    allocate_buckets,
    bucket_checksum,
    layout_for,
    lone_slot,
    pack,
    plan_layout,
    unpack,
    weighted_word_sum,
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


def test_word_sum_of_any_length_and_offset_detects_a_flipped_byte():
    data = torch.arange(300, dtype=torch.int64).view(torch.uint8).clone()
    for view in (data[:2400], data[:2397], data[3:2003]):  # whole words, a tail, an unaligned start
        before = weighted_word_sum(view)
        view[len(view) - 1] ^= 1
        assert weighted_word_sum(view) != before
        view[len(view) - 1] ^= 1
        assert weighted_word_sum(view) == before


def test_checksum_detects_a_flipped_byte():
    bucket = torch.arange(256, dtype=torch.int64).view(torch.uint8).clone()
    before = bucket_checksum(bucket)
    bucket[100] ^= 1
    assert bucket_checksum(bucket) != before


def test_direct_layout_gives_large_tensors_a_bucket_of_their_own_and_packs_the_rest_in_order():
    specs = [("norm0", (10,), torch.float32), ("big0", (300,), torch.float32), ("norm1", (20,), torch.float32),
             ("big1", (257,), torch.bfloat16), ("norm2", (30,), torch.float32)]  # fmt: skip
    layout = plan_layout(specs, 4096, direct_bytes=500)
    buckets = {s.name: s.bucket for s in layout.slots}
    assert buckets["norm0"] == buckets["norm1"] == buckets["norm2"] == 0  # the open shared bucket
    assert (buckets["big0"], buckets["big1"]) == (1, 2)
    assert [lone_slot(layout, i) is not None for i in range(layout.num_buckets)] == [False, True, True]
    assert lone_slot(layout, 2).nbytes == 514 and layout.bucket_nbytes[2] == 576  # padding is never sent
    assert plan_layout(specs, 4096).num_buckets == 1  # without direct_bytes: greedy, all in one bucket
    with pytest.raises(ValueError, match="direct-send size"):
        plan_layout(specs, 4096, direct_bytes=8)


_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.uint8]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 700), st.sampled_from(_DTYPES)), min_size=1, max_size=12),
    bucket_bytes=st.integers(64, 2048),
    direct_bytes=st.one_of(st.none(), st.integers(64, 3000)),
)
def test_layout_invariants_hold_with_and_without_direct_buckets(sizes, bucket_bytes, direct_bytes):
    specs = [(f"t{i}", (n,), dtype) for i, (n, dtype) in enumerate(sizes)]
    layout = plan_layout(specs, bucket_bytes, direct_bytes)
    assert [s.name for s in layout.slots] == [name for name, _, _ in specs]
    assert all(n % ALIGN == 0 for n in layout.bucket_nbytes)
    spans: dict[int, list[tuple[int, int]]] = {}
    for slot in layout.slots:
        assert slot.offset % ALIGN == 0 and slot.offset + slot.nbytes <= layout.bucket_nbytes[slot.bucket]
        spans.setdefault(slot.bucket, []).append((slot.offset, slot.offset + slot.nbytes))
        alone = direct_bytes is not None and slot.nbytes >= direct_bytes
        if alone or slot.nbytes > bucket_bytes:
            assert lone_slot(layout, slot.bucket) == slot
    for bucket, ranges in spans.items():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # no overlap
        if lone_slot(layout, bucket) is None:
            assert layout.bucket_nbytes[bucket] <= bucket_bytes
    assert set(spans) == set(range(layout.num_buckets))  # no empty bucket
    g = torch.Generator().manual_seed(len(sizes))
    named = {name: torch.randint(0, 255, shape, generator=g).to(dtype) for name, shape, dtype in specs}
    buckets = allocate_buckets(layout)
    pack(layout, named, buckets)
    assert all(torch.equal(view, named[name]) for name, view in unpack(layout, buckets))
