"""Token-mean PPO-clip policy loss over packed sequences: the torch reference (a Triton kernel must match it).

Inputs are flat per-token tensors [T] of B packed trajectories, delimited by `cu_seqlens` [B + 1]
(cu_seqlens[0] = 0, cu_seqlens[-1] = T), and an action mask [T] that is 1 on generated action tokens and 0
on prompt, observation and padding tokens. `ppo_token_terms` holds all per-token math, elementwise:

    ratio   = exp(clamp(logp - old, +-clamp))                              (0 where mask = 0)
    pg      = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))
    pg      = min(pg, -c A)   where A < 0                                   (negative dual-clip, c > 1)
    w       = min(exp(old - behaviour), cap)                                (truncated IS, SPO++ / verl)
            | exp(old - behaviour), or 0 where it exceeds cap               (decoupled PPO, AReaL)
    loss_t  = mask * w * pg

`old` is the proximal policy (trainer log-probs at the start of the optimizer step) and `behaviour` the
log-probs the rollout engine sampled with; both, and A, are constants (no gradient). Masked positions are
zeroed *before* the exp, so garbage there (inf, NaN, huge log-ratios) never reaches the loss or gradients.

`packed_policy_loss` divides the summed per-token loss by `num_global_action_tokens`, the action-token count
of the whole optimizer step across micro-batches and data-parallel ranks. Invariant: summing the outputs
of any split of a batch (micro-batches, ranks) gives the loss and gradients of the whole batch; DP
gradients must therefore be summed across ranks (or the loss scaled by the DP size when the wrapper
averages). Diagnostics carry the same normalisation, so they sum to global means; max |A| reduces by max.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class LossConfig:
    """PPO-clip with asymmetric clip, negative dual-clip and behaviour-policy importance weights.

    clip_low / clip_high: ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO 0.2 / 0.28).
    dual_clip_c: per-token loss capped at -c*A for A < 0 (SPO++ 2, SPO 10); None disables.
    is_cap: cap on the behaviour weight exp(old - behaviour) (SPO++ 2); None leaves it unbounded.
    decoupled: False truncates the weight at is_cap; True is AReaL's decoupled PPO, which drops tokens
        whose weight exceeds is_cap and keeps the others' weights untruncated (needs is_cap).
    log_ratio_clamp: log-ratios are clamped to +-this before exp (verl uses 20).
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


class TokenTerms(NamedTuple):
    """Per-token outputs [T]; every entry is 0 where the action mask is 0."""

    loss: torch.Tensor  # w * pg; the only term with a gradient (w.r.t. logprobs)
    is_weight: torch.Tensor  # behaviour importance weight applied
    clipped: torch.Tensor  # 1 where the PPO clip is the active branch
    dual_clipped: torch.Tensor  # 1 where the dual-clip cap -c*A is the active branch
    is_capped: torch.Tensor  # 1 where the behaviour weight exceeded is_cap (truncated or dropped)
    approx_kl: torch.Tensor  # k3 estimate of KL(old || new): ratio - 1 - log ratio


def _behaviour_weight(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    log_w = torch.where(mask, old_logprobs - behaviour_logprobs, 0.0)
    w = torch.exp(log_w.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)).detach()
    if cfg.is_cap is None:
        return w, torch.zeros_like(w)
    capped = w > cfg.is_cap
    w = torch.where(capped, 0.0, w) if cfg.decoupled else w.clamp(max=cfg.is_cap)
    return w, capped.to(w.dtype)


def ppo_token_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    cfg: LossConfig,
) -> TokenTerms:
    """Per-token PPO terms over flat [T] tensors; see the module docstring for the formulas."""
    mask = action_mask.bool()
    old = old_logprobs.detach()
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio = torch.where(mask, logprobs - old, 0.0).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    dual = torch.zeros_like(clipped)
    if cfg.dual_clip_c is not None:
        cap = -cfg.dual_clip_c * adv
        dual = (adv < 0) & (cap < pg)
        pg = torch.where(dual, cap, pg)
    w, is_capped = _behaviour_weight(old, behaviour_logprobs.detach(), mask, cfg)
    zero = torch.zeros_like(pg)
    kl = (ratio.detach() - 1.0) - log_ratio.detach()
    return TokenTerms(
        loss=torch.where(mask, w * pg, zero),
        is_weight=torch.where(mask, w, zero),
        clipped=(clipped & mask).to(pg.dtype),
        dual_clipped=(dual & mask).to(pg.dtype),
        is_capped=torch.where(mask, is_capped, zero),
        approx_kl=torch.where(mask, kl, zero),
    )


def _check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with B + 1 entries, got shape {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens must run from 0 to T = {num_tokens}, got {int(cu_seqlens[0])}..{int(cu_seqlens[-1])}"
        )
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    return lengths


def broadcast_to_tokens(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-trajectory values [B] -> per-token [T]: trajectory b's value on tokens cu[b]:cu[b+1]."""
    lengths = _check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]) if cu_seqlens.numel() else 0)
    if values.shape != lengths.shape:
        raise ValueError(f"{values.shape[0]} values for {lengths.shape[0]} trajectories in cu_seqlens")
    return torch.repeat_interleave(values, lengths.to(device=values.device, dtype=torch.long))


@dataclass(frozen=True)
class PolicyLossOutput:
    """Loss and diagnostics of one micro-batch, each already divided by the global action-token count.

    Sum `loss` and the fractions over micro-batches and ranks to get the step's values; take the max of
    `max_abs_advantage`. Diagnostics are detached.
    """

    loss: torch.Tensor
    approx_kl: torch.Tensor
    clip_fraction: torch.Tensor
    dual_clip_fraction: torch.Tensor
    is_capped_fraction: torch.Tensor
    max_abs_advantage: torch.Tensor
    num_action_tokens: int


def packed_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    action_mask: torch.Tensor,
    num_global_action_tokens: int,
    cfg: LossConfig,
) -> PolicyLossOutput:
    """Token-mean PPO loss of packed trajectories; `advantages` is per trajectory [B], broadcast to tokens."""
    flat = (logprobs, old_logprobs, behaviour_logprobs, action_mask)
    if any(t.dim() != 1 or t.shape != logprobs.shape for t in flat):
        raise ValueError(f"per-token inputs must all be 1-D of shape {tuple(logprobs.shape)}")
    _check_cu_seqlens(cu_seqlens, logprobs.shape[0])
    num_local = int(action_mask.bool().sum())
    if num_global_action_tokens < max(num_local, 1):
        raise ValueError(
            f"num_global_action_tokens {num_global_action_tokens} < this batch's {num_local} (or 0)"
        )
    token_adv = broadcast_to_tokens(advantages.to(logprobs.dtype), cu_seqlens)
    terms = ppo_token_terms(logprobs, old_logprobs, behaviour_logprobs, token_adv, action_mask, cfg)
    denom = float(num_global_action_tokens)
    masked_adv = torch.where(action_mask.bool(), token_adv.abs(), 0.0)
    return PolicyLossOutput(
        loss=terms.loss.sum() / denom,
        approx_kl=terms.approx_kl.sum().detach() / denom,
        clip_fraction=terms.clipped.sum() / denom,
        dual_clip_fraction=terms.dual_clipped.sum() / denom,
        is_capped_fraction=terms.is_capped.sum() / denom,
        max_abs_advantage=masked_adv.max().detach() if masked_adv.numel() else masked_adv.sum(),
        num_action_tokens=num_local,
    )
