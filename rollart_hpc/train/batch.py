"""`PackedBatch`, the trainer's input, and its splits: data-parallel shards, micro-batches, padded rows.

A batch packs B sequences into flat per-token tensors of length T, delimited by `cu_seqlens` [B + 1].
Invariants (checked on construction):
- `tokens` int64 [T]; `action_mask` bool [T]; `behaviour_logprobs` and `advantages` float32 [T];
  `cu_seqlens` int64 [B + 1], from 0 to T, non-decreasing; `seq_ids` is empty or has B entries.
- An action token is predicted from the previous position of its own sequence, so the first token of
  every sequence is never an action token. Non-action tokens carry behaviour log-prob and advantage 0.
Splits only select whole sequences, so the union of the parts is the batch (tokens, masks, counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

_PER_TOKEN = ("tokens", "action_mask", "behaviour_logprobs", "advantages")


@dataclass(frozen=True)
class PackedBatch:
    """B packed sequences; see the module docstring for the invariants."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    action_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    seq_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_dtypes(self)
        t = self.tokens.shape[0]
        for name in _PER_TOKEN:
            if getattr(self, name).shape != (t,):
                raise ValueError(f"{name} must have shape ({t},), got {tuple(getattr(self, name).shape)}")
        _check_cu_seqlens(self.cu_seqlens, t)
        if self.seq_ids and len(self.seq_ids) != self.num_sequences:
            raise ValueError(f"{len(self.seq_ids)} seq_ids for {self.num_sequences} sequences")
        if bool(self.action_mask[self.cu_seqlens[:-1][self.lengths > 0]].any()):
            raise ValueError("the first token of a sequence cannot be an action token")

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum())

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]


def _check_dtypes(batch: PackedBatch) -> None:
    expected = {
        "tokens": torch.int64,
        "cu_seqlens": torch.int64,
        "action_mask": torch.bool,
        "behaviour_logprobs": torch.float32,
        "advantages": torch.float32,
    }
    for name, dtype in expected.items():
        if getattr(batch, name).dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {getattr(batch, name).dtype}")


def _check_cu_seqlens(cu: torch.Tensor, num_tokens: int) -> None:
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens must be 1-D and run from 0 to T={num_tokens}, got {cu.tolist()[:8]}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def from_sequences(
    tokens: list[list[int]],
    action_masks: list[list[int]],
    behaviour_logprobs: list[list[float]],
    advantages: list[list[float]],
    seq_ids: tuple[str, ...] = (),
) -> PackedBatch:
    """Pack per-sequence lists (one entry per token) into a PackedBatch."""
    lengths = [len(t) for t in tokens]
    cu = torch.zeros(len(tokens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)

    def flat(rows: list[list[float]] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([x for row in rows for x in row], dtype=dtype).reshape(-1)

    return PackedBatch(
        tokens=flat(tokens, torch.int64),
        cu_seqlens=cu,
        action_mask=flat(action_masks, torch.int64).bool(),
        behaviour_logprobs=flat(behaviour_logprobs, torch.float32),
        advantages=flat(advantages, torch.float32),
        seq_ids=seq_ids,
    )


def token_positions(batch: PackedBatch, indices: list[int]) -> torch.Tensor:
    """Flat positions in `batch` of the tokens of sequences `indices`, in that order."""
    starts, ends = batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()
    parts = [torch.arange(starts[i], ends[i]) for i in indices]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def select(batch: PackedBatch, indices: list[int]) -> PackedBatch:
    """The sub-batch of sequences `indices`, in that order."""
    idx = token_positions(batch, indices)
    cu = torch.zeros(len(indices) + 1, dtype=torch.int64)
    if indices:
        cu[1:] = batch.lengths[indices].cumsum(0)
    return PackedBatch(
        tokens=batch.tokens[idx],
        cu_seqlens=cu,
        action_mask=batch.action_mask[idx],
        behaviour_logprobs=batch.behaviour_logprobs[idx],
        advantages=batch.advantages[idx],
        seq_ids=tuple(batch.seq_ids[i] for i in indices) if batch.seq_ids else (),
    )


def split_across_ranks(batch: PackedBatch, num_ranks: int) -> list[PackedBatch]:
    """Assign whole sequences to `num_ranks` shards balanced by token count (longest first, to the
    lightest shard; ties to the lower rank). Deterministic; a shard may be empty when B < num_ranks."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    loads = [0] * num_ranks
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    lengths = batch.lengths.tolist()
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += lengths[i]
    return [select(batch, sorted(p)) for p in parts]


def micro_batch_groups(batch: PackedBatch, max_tokens: int) -> list[list[int]]:
    """Sequence indices of micro-batches whose padded size (rows x longest row) is at most `max_tokens`;
    sequences are taken longest first, so padding stays small. A longer sequence is a micro-batch alone."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = batch.lengths.tolist()
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_micro_batches(batch: PackedBatch, max_tokens: int) -> list[PackedBatch]:
    """The micro-batches of `micro_batch_groups` as PackedBatches."""
    return [select(batch, g) for g in micro_batch_groups(batch, max_tokens)]


class PaddedRows(NamedTuple):
    """Right-padded rows of one micro-batch for a causal model with attention_mask=None.

    `targets[i, j]` is the token after `input_ids[i, j]` (0 past the end); `target_mask[i, j]` is True where
    that target is an action token; `target_valid[i, j]` where a target exists. `flat_index[i, j]` is the
    flat position of the target in the batch (valid entries only).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    target_mask: torch.Tensor
    target_valid: torch.Tensor
    flat_index: torch.Tensor


def to_padded_rows(batch: PackedBatch, multiple: int = 1) -> PaddedRows:
    """Rows [b, s] with s = the longest sequence rounded up to `multiple` (sequence parallelism splits
    s over the tensor-parallel ranks); right padding with token 0 (never attended by the valid
    positions under a causal mask)."""
    b = batch.num_sequences
    s = max(int(batch.lengths.max()), 1) if b else 1
    s = -(-s // multiple) * multiple
    pos = torch.arange(s).expand(b, s)
    starts, lengths = batch.cu_seqlens[:-1, None], batch.lengths[:, None]
    valid = pos < lengths
    target_valid = pos + 1 < lengths
    flat_index = torch.where(target_valid, starts + pos + 1, 0)
    if batch.num_tokens == 0:
        zeros = torch.zeros(b, s, dtype=torch.int64)
        return PaddedRows(zeros, zeros, target_valid, target_valid, flat_index)
    input_ids = torch.where(valid, batch.tokens[torch.where(valid, starts + pos, 0)], 0)
    targets = torch.where(target_valid, batch.tokens[flat_index], 0)
    target_mask = target_valid & batch.action_mask[flat_index]
    return PaddedRows(input_ids, targets, target_mask, target_valid, flat_index)


def concat(batches: list[PackedBatch]) -> PackedBatch:
    """The sequences of `batches`, in order, as one batch (the inverse of splitting into contiguous parts)."""
    if not batches:
        raise ValueError("concat needs at least one batch")
    offsets = [0]
    for b in batches:
        offsets.append(offsets[-1] + b.num_tokens)
    cu = torch.cat(
        [batches[0].cu_seqlens[:1]] + [b.cu_seqlens[1:] + o for b, o in zip(batches, offsets, strict=False)]
    )
    ids = (
        tuple(i for b in batches for i in b.seq_ids)
        if all(b.seq_ids or not b.num_sequences for b in batches)
        else ()
    )
    return PackedBatch(
        tokens=torch.cat([b.tokens for b in batches]),
        cu_seqlens=cu,
        action_mask=torch.cat([b.action_mask for b in batches]),
        behaviour_logprobs=torch.cat([b.behaviour_logprobs for b in batches]),
        advantages=torch.cat([b.advantages for b in batches]),
        seq_ids=ids,
    )
