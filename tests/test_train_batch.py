"""PackedBatch validation, data-parallel and micro-batch splits, padded rows."""

from __future__ import annotations

import pytest
import torch

from rollart_hpc.train.batch import (
    PackedBatch,
    from_sequences,
    micro_batch_groups,
    select,
    split_across_ranks,
    split_micro_batches,
    to_padded_rows,
    token_positions,
)


def _batch(lengths: list[int], seed: int = 0) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    tokens, masks, blp, adv = [], [], [], []
    for n in lengths:
        tokens.append(torch.randint(1, 100, (n,), generator=gen).tolist())
        mask = [0] + [int(x) for x in (torch.rand(n - 1, generator=gen) > 0.4).tolist()]
        masks.append(mask)
        blp.append([-float(i + 1) * m for i, m in enumerate(mask)])
        adv.append([0.5 * m for m in mask])
    ids = tuple(f"s{i}" for i in range(len(lengths)))
    return from_sequences(tokens, masks, blp, adv, seq_ids=ids)


def test_from_sequences_packs_flat_tensors() -> None:
    b = _batch([3, 5, 2])
    assert b.cu_seqlens.tolist() == [0, 3, 8, 10]
    assert b.num_sequences == 3 and b.num_tokens == 10
    assert b.tokens.dtype == torch.int64 and b.action_mask.dtype == torch.bool
    assert b.num_action_tokens == int(b.action_mask.sum())


def test_validation_rejects_bad_batches() -> None:
    good = _batch([3, 4])
    with pytest.raises(ValueError, match="first token"):
        from_sequences([[1, 2]], [[1, 0]], [[0.0, 0.0]], [[0.0, 0.0]])
    with pytest.raises(ValueError, match="cu_seqlens"):
        PackedBatch(
            good.tokens, torch.tensor([0, 3, 6]), good.action_mask, good.behaviour_logprobs, good.advantages
        )
    with pytest.raises(ValueError, match="advantages"):
        PackedBatch(
            good.tokens, good.cu_seqlens, good.action_mask, good.behaviour_logprobs, good.advantages[:3]
        )
    with pytest.raises(ValueError, match="float32"):
        PackedBatch(
            good.tokens, good.cu_seqlens, good.action_mask, good.behaviour_logprobs.double(), good.advantages
        )
    with pytest.raises(ValueError, match="seq_ids"):
        PackedBatch(
            good.tokens, good.cu_seqlens, good.action_mask, good.behaviour_logprobs, good.advantages, ("a",)
        )


def test_select_and_token_positions_agree() -> None:
    b = _batch([3, 5, 2, 4])
    sub = select(b, [2, 0])
    assert sub.seq_ids == ("s2", "s0")
    pos = token_positions(b, [2, 0])
    assert pos.tolist() == [8, 9, 0, 1, 2]
    assert torch.equal(sub.tokens, b.tokens[pos]) and torch.equal(sub.advantages, b.advantages[pos])
    assert select(b, []).num_tokens == 0


def test_split_across_ranks_balances_tokens_and_keeps_every_sequence() -> None:
    lengths = [50, 10, 40, 30, 20, 25, 5]
    b = _batch(lengths)
    parts = split_across_ranks(b, 3)
    loads = [p.num_tokens for p in parts]
    assert sum(loads) == b.num_tokens
    assert max(loads) - min(loads) <= max(lengths) // 2
    assert sorted(i for p in parts for i in p.seq_ids) == sorted(b.seq_ids)
    assert sum(p.num_action_tokens for p in parts) == b.num_action_tokens
    assert [p.num_sequences for p in split_across_ranks(_batch([4]), 2)] == [1, 0]


def test_micro_batches_respect_the_padded_token_budget() -> None:
    lengths = [7, 3, 9, 2, 6, 6, 1, 20]
    b = _batch(lengths)
    groups = micro_batch_groups(b, max_tokens=16)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        padded = len(g) * max(lengths[i] for i in g)
        assert padded <= 16 or len(g) == 1
    micro = split_micro_batches(b, 16)
    assert sum(m.num_tokens for m in micro) == b.num_tokens
    assert len(split_micro_batches(b, 10_000)) == 1


def test_padded_rows_shift_targets_by_one_within_each_sequence() -> None:
    b = _batch([3, 5])
    rows = to_padded_rows(b)
    assert rows.input_ids.shape == (2, 5)
    assert rows.input_ids[0].tolist() == b.tokens[:3].tolist() + [0, 0]
    assert rows.targets[0].tolist() == b.tokens[1:3].tolist() + [0, 0, 0]
    assert rows.targets[1].tolist() == b.tokens[4:8].tolist() + [0]
    assert rows.target_valid.sum().item() == b.num_tokens - b.num_sequences
    assert torch.equal(rows.target_mask[rows.target_valid], b.action_mask[rows.flat_index[rows.target_valid]])
    assert int(rows.target_mask.sum()) == b.num_action_tokens
