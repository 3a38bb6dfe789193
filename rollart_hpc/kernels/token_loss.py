"""Torch reference of the SPO++ per-token terms and their one reduction to the token-mean loss.

Inputs are flat per-token tensors [T] and an action mask [T] that is 1 on generated action tokens and 0
on prompt, observation and padding tokens. `ppo_token_terms` holds all per-token math, elementwise:

    ratio   = exp(clamp(logp - old, +-clamp))                              (0 where mask = 0)
    pg      = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))
    pg      = min(pg, -c A)   where A < 0                                   (negative dual-clip, c > 1)
    w       = min(exp(old - behaviour), cap)                                (truncated IS, SPO++ / verl)
            | exp(old - behaviour), or 0 where it exceeds cap               (decoupled PPO, AReaL)
    loss_t  = mask * w * pg

`old` is the proximal policy and `behaviour` the log-probs the rollout engine sampled with; both, and A,
are constants (no gradient). Masked positions are zeroed *before* the exp, so garbage there (inf, NaN,
huge log-ratios) never reaches the loss or gradients. The Triton kernel (`lm_head_triton`) computes the
same terms in-tile; `lm_head_reference` calls this function.

`reduce_token_terms` is the only place that turns per-token terms into the loss and its diagnostics: it
sums them and divides by `num_global_action_tokens`, the action-token count of the whole optimizer step
across micro-batches and data-parallel ranks. Invariant: summing the outputs of any split of a batch
(micro-batches, ranks) gives the loss and gradients of the whole batch, so DP gradients are summed, never
averaged. Diagnostics carry the same normalisation, so they sum to global means; max |A| reduces by max.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from rollart_hpc.kernels.common import KernelLossConfig

# LossDiagnostics fields that add up over micro-batches and ranks to the step's global token means.
SUMMED_DIAGNOSTICS = ("approx_kl", "clip_fraction", "dual_clip_fraction", "is_capped_fraction", "is_weight")


class TokenTerms(NamedTuple):
    """Per-token outputs [T]; every entry is 0 where the action mask is 0."""

    loss: torch.Tensor  # w * pg; the only term with a gradient (w.r.t. logprobs)
    is_weight: torch.Tensor  # behaviour importance weight applied
    clipped: torch.Tensor  # 1 where the PPO clip is the active branch
    dual_clipped: torch.Tensor  # 1 where the dual-clip cap -c*A is the active branch
    is_capped: torch.Tensor  # 1 where the behaviour weight exceeded is_cap (truncated or dropped)
    approx_kl: torch.Tensor  # k3 estimate of KL(old || new): ratio - 1 - log ratio


def _behaviour_weight(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: KernelLossConfig,
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
    cfg: KernelLossConfig,
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


@dataclass(frozen=True)
class LossDiagnostics:
    """Detached diagnostics of one micro-batch, each divided by the global action-token count like the loss.

    Sum the `SUMMED_DIAGNOSTICS` fields (and `entropy`) over micro-batches and ranks to get the step's
    token means; take the max of `max_abs_advantage`. `entropy` is the summed action-token entropy /
    denominator and `token_entropy` the per-token entropy [T], when the fused path was asked for them.
    """

    approx_kl: torch.Tensor
    clip_fraction: torch.Tensor
    dual_clip_fraction: torch.Tensor
    is_capped_fraction: torch.Tensor
    is_weight: torch.Tensor
    max_abs_advantage: torch.Tensor
    num_action_tokens: int
    entropy: torch.Tensor | None = None
    token_entropy: torch.Tensor | None = None

    def summed(self) -> dict[str, torch.Tensor]:
        """The diagnostics that add up across micro-batches and ranks, keyed by `SUMMED_DIAGNOSTICS`."""
        return {name: getattr(self, name) for name in SUMMED_DIAGNOSTICS}


def check_num_global_action_tokens(num_global_action_tokens: int, num_local: int) -> None:
    """ValueError unless the global denominator covers this micro-batch's action tokens (and is >= 1)."""
    if num_global_action_tokens < max(num_local, 1):
        raise ValueError(
            f"num_global_action_tokens {num_global_action_tokens} < this batch's {num_local} (or 0)"
        )


def reduce_token_terms(
    terms: TokenTerms,
    action_mask: torch.Tensor,
    advantages: torch.Tensor,
    num_global_action_tokens: int,
    token_entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossDiagnostics]:
    """(loss, diagnostics): per-token terms summed and divided by the global action-token count.

    `advantages` are per token [T]; only their masked max |A| is read. The loss keeps the gradient of
    `terms.loss`; everything else is detached."""
    mask = action_mask.bool()
    num_local = int(mask.sum())
    check_num_global_action_tokens(num_global_action_tokens, num_local)
    denom = float(num_global_action_tokens)
    abs_adv = torch.where(mask, advantages.detach().abs().to(terms.loss.dtype), 0.0)
    entropy = None
    if token_entropy is not None:
        entropy = torch.where(mask, token_entropy.detach(), 0.0).sum() / denom
    diagnostics = LossDiagnostics(
        approx_kl=terms.approx_kl.sum().detach() / denom,
        clip_fraction=terms.clipped.sum() / denom,
        dual_clip_fraction=terms.dual_clipped.sum() / denom,
        is_capped_fraction=terms.is_capped.sum() / denom,
        is_weight=terms.is_weight.sum().detach() / denom,
        max_abs_advantage=abs_adv.max() if abs_adv.numel() else abs_adv.sum(),
        num_action_tokens=num_local,
        entropy=entropy,
        token_entropy=token_entropy,
    )
    return terms.loss.sum() / denom, diagnostics
