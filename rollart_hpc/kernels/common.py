"""Types shared by the fused LM-head log-prob kernels and their torch reference.

Both implementations (`lm_head_triton`, `lm_head_reference`) expose the same two operations on packed
tokens, so the autograd functions in `policy_loss` are written once (and check the inputs once, with
`check_shapes` and `check_loss_inputs`, before calling either):

    forward(hidden [T, H], weight [V, H], targets [T], inputs, cfg, with_entropy, tuning) -> TokenForward
    grads(hidden, weight, targets, lse [T], g [T], tuning) -> (d hidden [T, H], d weight [V, H])

`g` is d(loss)/d(logprob) per token; the gradient of the logits is g_t * (onehot(target_t) - softmax_t),
recomputed tile by tile from `lse`, never stored for all of [T, V]. Per-token outputs are float32
(float64 for float64 inputs on the torch reference).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

LEVELS = ("token", "sequence")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_INS = ("loss", "reward")


@dataclass(frozen=True)
class KernelLossConfig:
    """The policy loss's parameters, read by the kernels and the torch terms alike (`rollart_hpc.algo.loss`
    calls it LossConfig and builds it from the [algo] section).

    clip_low / clip_high: ratio clipped to [1 - clip_low, 1 + clip_high].
    dual_clip_c: per-token loss capped at -c*A for A < 0; None disables.
    is_cap: cap on the behaviour weight exp(old - behaviour); None leaves it unbounded.
    decoupled: False truncates the weight at is_cap; True drops tokens whose weight exceeds it.
    log_ratio_clamp: log-ratios are clamped to +-this before exp.
    ratio_level: "token" (PPO: ratio_t = exp(logp_t - old_t)) or "sequence" (GSPO: every action token of a
        trajectory takes s_i = exp(mean over its action tokens of (logp - old)), clipped at the sequence
        level; d s_i / d logp_t = s_i / |y_i|, the exact gradient of GSPO's objective).
    is_level: "token" (behaviour weight exp(old_t - behaviour_t)) or "sequence" (exp of the mean over the
        trajectory's action tokens of (old - behaviour), the same weight on all its tokens).
    is_reject_low / is_reject_high: tokens (is_level "token") or whole trajectories ("sequence") whose
        behaviour weight lies below / above these bounds get weight 0 (None: no bound).
    loss_agg: how per-token losses become the step's loss (`token_loss.aggregation_weights`):
        "token_mean" (divide by the step's global action-token count), "seq_mean_token_mean" (each
        trajectory's mean over its action tokens, then the mean over the step's global trajectory count),
        "seq_mean_token_sum_norm" (each trajectory's sum over its action tokens divided by the constant
        loss_agg_tokens, then the mean over the trajectories: Dr. GRPO's fixed denominator, batch size x
        loss_agg_tokens, the same every step).
    entropy_coef: weight of the entropy bonus (the loss subtracts entropy_coef x the action-token entropy,
        aggregated as the loss); needs the entropy of the softmax, so it needs hidden states and LM head.
    kl_coef / kl_estimator / kl_in: KL to a reference policy (0 = off), estimated per action token by
        "k1" | "k2" | "k3" (`token_loss.kl_estimate`); "loss" adds kl_coef x it to the per-token loss
        (aggregated as the loss, gradient through the current log-probs), "reward" subtracts kl_coef x the
        reward-to-go of the proximal policy's estimate from each token's advantage (no gradient).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: float | None = 2.0
    is_cap: float | None = 2.0
    decoupled: bool = False
    log_ratio_clamp: float = 20.0
    ratio_level: str = "token"
    is_level: str = "token"
    is_reject_low: float | None = None
    is_reject_high: float | None = None
    loss_agg: str = "token_mean"
    loss_agg_tokens: int = 0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in: str = "loss"

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
        self._check_levels()
        self._check_reject()
        if (self.loss_agg == "seq_mean_token_sum_norm") != (self.loss_agg_tokens > 0):
            raise ValueError(
                f"loss_agg_tokens > 0 goes with loss_agg 'seq_mean_token_sum_norm' only, got "
                f"{self.loss_agg!r} with {self.loss_agg_tokens}"
            )
        if self.entropy_coef < 0 or self.kl_coef < 0:
            raise ValueError(
                f"entropy_coef and kl_coef must be >= 0, got {self.entropy_coef}, {self.kl_coef}"
            )
        if self.kl_estimator not in KL_ESTIMATORS or self.kl_in not in KL_INS:
            raise ValueError(
                f"kl_estimator in {KL_ESTIMATORS}, kl_in in {KL_INS}: {self.kl_estimator!r}, {self.kl_in!r}"
            )

    def _check_levels(self) -> None:
        for name in ("ratio_level", "is_level"):
            if getattr(self, name) not in LEVELS:
                raise ValueError(f"{name} must be one of {LEVELS}, got {getattr(self, name)!r}")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {self.loss_agg!r}")

    def _check_reject(self) -> None:
        low, high = self.is_reject_low, self.is_reject_high
        if low is not None and not 0 < low < 1:
            raise ValueError(f"is_reject_low must lie in (0, 1), got {low}")
        if high is not None and high <= 1:
            raise ValueError(f"is_reject_high must be > 1, got {high}")
        if high is not None and self.decoupled:
            raise ValueError(
                "decoupled drops weights above is_cap and is_reject_high drops them too: set one"
            )
        if high is not None and self.is_cap is not None and self.is_cap >= high:
            raise ValueError(f"is_cap {self.is_cap} >= is_reject_high {high} never acts: remove is_cap")

    @property
    def needs_sequences(self) -> bool:
        """Whether the loss reads trajectory boundaries (sequence-level ratio or weight, or aggregation)."""
        kl_reward = self.kl_coef > 0 and self.kl_in == "reward"
        return "sequence" in (self.ratio_level, self.is_level) or self.loss_agg != "token_mean" or kl_reward

    @property
    def in_kernel(self) -> bool:
        """Whether the Triton epilogue computes these per-token terms (token-level ratio and weight, no
        rejection bounds); other settings take the log-probs from the kernel and the terms from torch."""
        return (
            self.ratio_level == "token"
            and self.is_level == "token"
            and self.is_reject_low is None
            and self.is_reject_high is None
        )


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


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the torch paths' logits: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def budget_chunk(num_vocab: int, budget_elements: int) -> int:
    """Tokens per chunk so that one chunk of [tokens, num_vocab] logits holds about `budget_elements`."""
    return max(1, budget_elements // max(num_vocab, 1))


def token_slices(num_tokens: int, chunk: int) -> Iterator[slice]:
    """Consecutive slices of `chunk` tokens (the last one shorter) covering [0, num_tokens)."""
    for start in range(0, num_tokens, chunk):
        yield slice(start, min(start + chunk, num_tokens))


def mask_columns(logits: torch.Tensor, num_real: int) -> torch.Tensor:
    """Logits [..., V] with the columns from `num_real` on (a padded head's rows) set to -inf, so they carry
    no probability and no gradient; the input itself when there are none."""
    if num_real >= logits.shape[-1]:
        return logits
    return logits.index_fill(
        -1, torch.arange(num_real, logits.shape[-1], device=logits.device), float("-inf")
    )


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
