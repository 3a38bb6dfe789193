"""Types shared by the fused LM-head log-prob kernels and their torch reference.

Both implementations (`lm_head_triton`, `lm_head_reference`) expose the same two operations on packed
tokens, so the autograd functions in `policy_loss` are written once:

    forward(hidden [T, H], weight [V, H], targets [T], inputs, cfg, with_entropy, tuning) -> TokenForward
    grads(hidden, weight, targets, lse [T], g [T], tuning) -> (d hidden [T, H], d weight [V, H])

`g` is d(loss)/d(logprob) per token; the gradient of the logits is g_t * (onehot(target_t) - softmax_t),
recomputed tile by tile from `lse`, never stored for all of [T, V]. Per-token outputs are float32
(float64 for float64 inputs on the torch reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class KernelLossConfig:
    """The SPO++ per-token loss parameters the kernels read (the algorithm's config converts to this).

    clip_low / clip_high: ratio clipped to [1 - clip_low, 1 + clip_high].
    dual_clip_c: per-token loss capped at -c*A for A < 0; None disables.
    is_cap: cap on the behaviour weight exp(old - behaviour); None leaves it unbounded.
    decoupled: False truncates the weight at is_cap; True drops tokens whose weight exceeds it.
    log_ratio_clamp: log-ratios are clamped to +-this before exp.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: float | None = 2.0
    is_cap: float | None = 2.0
    decoupled: bool = False
    log_ratio_clamp: float = 20.0

    def __post_init__(self) -> None:
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise ValueError(
                f"need 0 < clip_low < 1 and clip_high > 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if self.is_cap is not None and self.is_cap <= 0:
            raise ValueError(f"is_cap must be > 0, got {self.is_cap}")
        if self.decoupled and self.is_cap is None:
            raise ValueError("decoupled PPO filters tokens by is_cap, so it needs one")
        if self.log_ratio_clamp <= 0:
            raise ValueError(f"log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")


@dataclass(frozen=True)
class KernelTuning:
    """Tile and chunk sizes; None picks a default for the device (GPU tiles, or large tiles to interpret).

    block_t / block_v / block_h: Triton tile of tokens x vocabulary x hidden (powers of 2, >= 16).
    num_vocab_splits: forward programs per token tile along the vocabulary (partial log-sum-exps merged).
    token_chunk / vocab_chunk: the backward materialises d logits for one token chunk x vocab chunk at a
        time (Triton) or the reference computes logits for one token chunk at a time (torch).
    """

    block_t: int | None = None
    block_v: int | None = None
    block_h: int | None = None
    num_vocab_splits: int | None = None
    token_chunk: int | None = None
    vocab_chunk: int | None = None
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_t", "block_v", "block_h"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {value}")
        for name in ("num_vocab_splits", "token_chunk", "vocab_chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


class LossInputs(NamedTuple):
    """Per-token policy-loss inputs [T]: constants of the loss (no gradient flows into them)."""

    action_mask: torch.Tensor
    old_logprobs: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor


class TokenForward(NamedTuple):
    """Per-token forward results [T] (see the module docstring for the dtype); loss terms are 0 where the action mask is 0."""

    logprobs: torch.Tensor  # log p(target), <= 0
    lse: torch.Tensor  # log-sum-exp of the logits, kept for the backward
    entropy: torch.Tensor | None  # entropy of the softmax, when asked for
    loss: torch.Tensor  # w * pg (unnormalised)
    coef: torch.Tensor  # d loss_t / d logprob_t
    is_weight: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    is_capped: torch.Tensor
    approx_kl: torch.Tensor


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_shapes(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """Raise ValueError naming the first inconsistent shape or dtype."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [T, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size differs: hidden {hidden.shape[1]}, weight {weight.shape[1]}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight dtypes differ: {hidden.dtype} vs {weight.dtype}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be [T] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be int32 or int64, got {targets.dtype}")


def check_loss_inputs(inputs: LossInputs, num_tokens: int) -> None:
    for name, tensor in zip(LossInputs._fields, inputs, strict=True):
        if tensor.shape != (num_tokens,):
            raise ValueError(f"{name} must be [T] = [{num_tokens}], got {tuple(tensor.shape)}")
