"""Torch reference of the SPO++ per-token terms and their one reduction to the token-mean loss.

Inputs are flat per-token tensors [T] and an action mask [T] that is 1 on generated action tokens and 0
on prompt, observation and padding tokens. `ppo_token_terms` holds all per-token math, elementwise:

    ratio   = exp(clamp(logp - old, +-clamp))                              (0 where mask = 0)
            | s_i = exp(mean_{t in i} (logp_t - old_t)) on every token of trajectory i     (GSPO)
    pg      = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))
    pg      = min(pg, -c A)   where A < 0                                   (negative dual-clip, c > 1)
    w       = min(exp(old - behaviour), cap)                                (truncated IS, SPO++ / verl)
            | exp(old - behaviour), or 0 where it exceeds cap               (decoupled PPO, AReaL)
            (is_level "sequence": exp(mean_{t in i} (old_t - behaviour_t)) for every token of i;
             w = 0 where the untruncated weight lies outside [is_reject_low, is_reject_high])
    loss_t  = mask * w * pg

`old` is the proximal policy and `behaviour` the log-probs the rollout engine sampled with; both, and A,
are constants (no gradient). Masked positions are zeroed *before* the exp, so garbage there (inf, NaN,
huge log-ratios) never reaches the loss or gradients. The Triton kernel (`lm_head_triton`) computes the
same terms in-tile; `lm_head_reference` calls this function.

`reduce_token_terms` is the only place that turns per-token terms into the loss and its diagnostics: it
sums them and divides by `num_global_action_tokens`, the action-token count of the whole optimizer step
across micro-batches and data-parallel ranks, or weighs them by `aggregation_weights` (per-trajectory
aggregations, whose denominators are the step's global trajectory count). Invariant: summing the outputs
of any split of a batch (micro-batches, ranks) gives the loss and gradients of the whole batch, so DP
gradients are summed, never averaged. Diagnostics carry the same normalisation, so they sum to global means; max |A| reduces by max.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from rollart_hpc.kernels.common import KernelLossConfig

# LossDiagnostics fields that add up over micro-batches and ranks to the step's global token means.
SUMMED_DIAGNOSTICS = (
    "approx_kl",
    "clip_fraction",
    "dual_clip_fraction",
    "is_capped_fraction",
    "is_rejected_fraction",
    "is_weight",
)


class TokenTerms(NamedTuple):
    """Per-token outputs [T]; every entry is 0 where the action mask is 0."""

    loss: torch.Tensor  # w * pg; the only term with a gradient (w.r.t. logprobs)
    is_weight: torch.Tensor  # behaviour importance weight applied
    clipped: torch.Tensor  # 1 where the PPO clip is the active branch
    dual_clipped: torch.Tensor  # 1 where the dual-clip cap -c*A is the active branch
    is_capped: torch.Tensor  # 1 where the behaviour weight exceeded is_cap (truncated or dropped)
    approx_kl: torch.Tensor  # k3 estimate of KL(old || new): ratio - 1 - log ratio
    is_rejected: torch.Tensor | None = None  # 1 where the weight lay outside the rejection bounds


def sequence_index(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The trajectory index of every token [T] of sequences packed by `cu_seqlens` [B + 1] (0 to T)."""
    if cu_seqlens.dim() != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens must be 1-D and run from 0 to T = {num_tokens}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.shape[0], device=cu_seqlens.device), lengths)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Per token [T]: the mean of `values` over the action tokens of the token's trajectory (`seq` [T] from
    `sequence_index`; a trajectory without action tokens gets 0). Differentiable in `values`."""
    num_seqs = int(seq.max()) + 1 if seq.numel() else 0
    masked = torch.where(mask, values, torch.zeros_like(values))
    sums = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq, masked)
    counts = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(
        0, seq, mask.to(values.dtype)
    )
    return (sums / counts.clamp(min=1.0))[seq]


def _behaviour_weight(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: KernelLossConfig,
    seq: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, capped, rejected) per token."""
    log_w = torch.where(mask, old_logprobs - behaviour_logprobs, 0.0)
    if cfg.is_level == "sequence":
        log_w = torch.where(mask, sequence_mean(log_w, mask, _need(seq)), 0.0)
    w = torch.exp(log_w.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)).detach()
    rejected = torch.zeros_like(mask)
    if cfg.is_reject_low is not None:
        rejected = rejected | (w < cfg.is_reject_low)
    if cfg.is_reject_high is not None:
        rejected = rejected | (w > cfg.is_reject_high)
    rejected = rejected & mask
    w = torch.where(rejected, 0.0, w)
    if cfg.is_cap is None:
        return w, torch.zeros_like(w), rejected.to(w.dtype)
    capped = w > cfg.is_cap
    w = torch.where(capped, 0.0, w) if cfg.decoupled else w.clamp(max=cfg.is_cap)
    return w, capped.to(w.dtype), rejected.to(w.dtype)


def _need(seq: torch.Tensor | None) -> torch.Tensor:
    if seq is None:
        raise ValueError("sequence-level ratio, weight or aggregation needs the trajectories' cu_seqlens")
    return seq


def _log_ratio(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
    cfg: KernelLossConfig,
    seq: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamped log-ratio the loss uses, per-token log-ratio for the KL estimate), both 0 off the mask."""
    token = torch.where(mask, logprobs - old, 0.0)
    if cfg.ratio_level == "sequence":  # GSPO: log s_i on each token, d log s_i / d logp_t = 1 / |y_i|
        used = torch.where(mask, sequence_mean(token, mask, _need(seq)), 0.0)
    else:
        used = token
    clamp = cfg.log_ratio_clamp
    return used.clamp(-clamp, clamp), token.detach().clamp(-clamp, clamp)


def ppo_token_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    cfg: KernelLossConfig,
    cu_seqlens: torch.Tensor | None = None,
) -> TokenTerms:
    """Per-token PPO terms over flat [T] tensors; see the module docstring for the formulas.

    cu_seqlens [B + 1]: the trajectories' boundaries, needed by the sequence-level ratio and weight."""
    mask = action_mask.bool()
    seq = sequence_index(cu_seqlens, mask.shape[0]) if cu_seqlens is not None else None
    old = old_logprobs.detach()
    adv = torch.where(mask, advantages.detach(), 0.0)
    log_ratio, token_log_ratio = _log_ratio(logprobs, old, mask, cfg, seq)
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
    w, is_capped, rejected = _behaviour_weight(old, behaviour_logprobs.detach(), mask, cfg, seq)
    zero = torch.zeros_like(pg)
    kl = (torch.exp(token_log_ratio) - 1.0) - token_log_ratio
    return TokenTerms(
        loss=torch.where(mask, w * pg, zero),
        is_weight=torch.where(mask, w, zero),
        clipped=(clipped & mask).to(pg.dtype),
        dual_clipped=(dual & mask).to(pg.dtype),
        is_capped=torch.where(mask, is_capped, zero),
        approx_kl=torch.where(mask, kl, zero),
        is_rejected=rejected.to(pg.dtype),
    )


def action_tokens_per_sequence(
    action_mask: torch.Tensor, cu_seqlens: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The action-token count of each trajectory [B] packed by `cu_seqlens` [B + 1]."""
    cu = _need(cu_seqlens).to(action_mask.device)
    seq = sequence_index(cu, action_mask.shape[0])
    counts = torch.zeros(cu.shape[0] - 1, dtype=dtype, device=action_mask.device)
    return counts.index_add(0, seq, action_mask.bool().to(dtype))


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token estimate [T] of KL(pi || ref) from tokens sampled by pi (Schulman's estimators), 0 off the
    mask, with log r = clamp(ref - logp, +-20): "k1" = -log r, "k2" = (log r)^2 / 2, "k3" = r - 1 - log r
    (unbiased and >= 0). Differentiable in `logprobs`; 0 wherever logprobs = ref_logprobs."""
    mask = action_mask.bool()
    log_r = torch.where(mask, ref_logprobs.detach() - logprobs, 0.0).clamp(-20.0, 20.0)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}: expected k1, k2 or k3")


def reward_to_go(values: torch.Tensor, action_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per token [T]: the sum of `values` over the action tokens of its trajectory from it to the end."""
    masked = torch.where(action_mask.bool(), values, 0.0)
    inclusive = masked.cumsum(0)
    ends = cu_seqlens[1:].to(values.device) - 1
    seq = sequence_index(cu_seqlens.to(values.device), values.shape[0])
    total_at_end = inclusive[ends.clamp(min=0)][seq] if values.numel() else inclusive
    return total_at_end - inclusive + masked


def aggregation_weights(
    action_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    cfg: KernelLossConfig,
    num_global_action_tokens: int,
    num_global_sequences: int | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight [T] of each token's loss in the step's loss (0 off the action tokens), by `cfg.loss_agg`:

    token_mean: 1 / N, N = the step's action tokens over all micro-batches and ranks;
    seq_mean_token_mean: 1 / (B L_i), B = the step's trajectories with an action token (global), L_i =
        the action tokens of the token's trajectory (a micro-batch holds whole trajectories);
    seq_mean_token_sum_norm: 1 / (B C), C = cfg.loss_agg_tokens (Dr. GRPO's constant).
    Summing weight x term over any split of the step's trajectories gives the step's loss."""
    mask = action_mask.bool()
    if cfg.loss_agg == "token_mean":
        check_num_global_action_tokens(num_global_action_tokens, int(mask.sum()))
        return mask.to(dtype) / float(num_global_action_tokens)
    seq = sequence_index(_need(cu_seqlens), mask.shape[0])
    counts = action_tokens_per_sequence(mask, cu_seqlens, dtype)
    num_local = int((counts > 0).sum())
    if num_global_sequences is None or num_global_sequences < max(num_local, 1):
        raise ValueError(f"num_global_sequences {num_global_sequences} < this batch's {num_local} (or 0)")
    per_token = (
        counts[seq]
        if cfg.loss_agg == "seq_mean_token_mean"
        else torch.full_like(mask, float(cfg.loss_agg_tokens), dtype=dtype)
    )
    return torch.where(mask, 1.0 / (per_token.clamp(min=1.0) * num_global_sequences), 0.0)


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
    is_rejected_fraction: torch.Tensor
    is_weight: torch.Tensor
    max_abs_advantage: torch.Tensor
    num_action_tokens: int
    entropy: torch.Tensor | None = None
    token_entropy: torch.Tensor | None = None
    kl: torch.Tensor | None = None  # summed KL-to-reference estimate / denominator, when given

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
    token_weights: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    token_kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossDiagnostics]:
    """(loss, diagnostics) of one micro-batch.

    The loss is sum_t weight_t (loss_t - entropy_coef H_t + kl_coef KL_t) over action tokens, with
    weight_t = `token_weights` (`aggregation_weights`) or, when None, 1 / num_global_action_tokens; the
    entropy and KL terms need `token_entropy` and `token_kl` with their gradients. Diagnostics (entropy included) are always summed and divided
    by the global action-token count, so they add up to the step's token means whatever the aggregation.
    `advantages` are per token [T]; only their masked max |A| is read. Diagnostics are detached."""
    mask = action_mask.bool()
    num_local = int(mask.sum())
    check_num_global_action_tokens(num_global_action_tokens, num_local)
    denom = float(num_global_action_tokens)
    abs_adv = torch.where(mask, advantages.detach().abs().to(terms.loss.dtype), 0.0)
    entropy = None
    if token_entropy is not None:
        entropy = torch.where(mask, token_entropy.detach(), 0.0).sum() / denom
    rejected = terms.is_rejected if terms.is_rejected is not None else torch.zeros_like(terms.clipped)
    diagnostics = LossDiagnostics(
        approx_kl=terms.approx_kl.sum().detach() / denom,
        clip_fraction=terms.clipped.sum() / denom,
        dual_clip_fraction=terms.dual_clipped.sum() / denom,
        is_capped_fraction=terms.is_capped.sum() / denom,
        is_rejected_fraction=rejected.sum() / denom,
        is_weight=terms.is_weight.sum().detach() / denom,
        max_abs_advantage=abs_adv.max() if abs_adv.numel() else abs_adv.sum(),
        num_action_tokens=num_local,
        entropy=entropy,
        token_entropy=token_entropy.detach() if token_entropy is not None else None,
        kl=torch.where(mask, token_kl.detach(), 0.0).sum() / denom if token_kl is not None else None,
    )
    per_token = terms.loss
    if entropy_coef:
        if token_entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - entropy_coef * torch.where(mask, token_entropy.to(per_token.dtype), 0.0)
    if kl_coef:
        if token_kl is None:
            raise ValueError("kl_coef > 0 in the loss needs the per-token KL estimate")
        per_token = per_token + kl_coef * torch.where(mask, token_kl.to(per_token.dtype), 0.0)
    if token_weights is None:
        return per_token.sum() / denom, diagnostics
    return (per_token * token_weights.to(per_token.dtype)).sum(), diagnostics
