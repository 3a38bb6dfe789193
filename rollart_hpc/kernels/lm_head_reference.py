"""Torch reference of the fused LM-head log-prob + policy loss: chunked over tokens, any device.

Same operations as `lm_head_triton` (see `common`): logits are computed for `token_chunk` tokens at a
time in float32 (float64 for float64 inputs), so memory is O(token_chunk * V), never [T, V]. The
per-token loss terms come from `token_loss.ppo_token_terms` itself (the function the training loss
uses), and d loss / d logprob from autograd through it, so this path equals the training reference by
construction. `shard_partials` and `grads(..., num_real=...)` serve a vocabulary-parallel, padded head shard
(`train.lm_head`) as their Triton counterparts do: padding rows masked, a target of another shard passed
as -1.

`eager_policy_loss` is the unfused baseline (full logits, autograd end to end) used by the benchmark
and, in float64, as the ground truth of the parity tests.
"""

from __future__ import annotations

import torch

from rollart_hpc.kernels.common import (
    KernelLossConfig,
    KernelTuning,
    LossInputs,
    TokenForward,
    budget_chunk,
    compute_dtype,
    mask_columns,
    token_slices,
)
from rollart_hpc.kernels.token_loss import TokenTerms, ppo_token_terms

LOGITS_BUDGET_ELEMENTS = 1 << 24  # 64 MiB of float32 logits per chunk


def token_chunk_size(num_vocab: int, tuning: KernelTuning) -> int:
    return tuning.token_chunk or budget_chunk(num_vocab, LOGITS_BUDGET_ELEMENTS)


def _owned(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each target is on this head, not -1 [T], the target where it is, else 0 [T] int64)."""
    owned = targets >= 0
    return owned, torch.where(owned, targets, 0).long()


def shard_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    num_real: int,
    tuning: KernelTuning,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per token [T] in the compute dtype, over the first `num_real` rows of the head `weight` (the rest is
    padding, masked): the log-sum-exp (-inf on a head of padding only), the target logit (0 where the target
    is -1: another shard's) and, `with_entropy`, the entropy of the softmax (0 on a head of
    padding only; else None)."""
    dtype = compute_dtype(hidden.dtype)
    w = weight.to(dtype)
    lse = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
    target_logit = torch.zeros_like(lse)
    entropy = torch.empty_like(lse) if with_entropy else None
    owned, picked = _owned(targets)
    for sl in token_slices(hidden.shape[0], token_chunk_size(weight.shape[0], tuning)):
        logits = mask_columns(hidden[sl].to(dtype) @ w.T, num_real)
        lse[sl] = torch.logsumexp(logits, dim=1)
        target_logit[sl] = torch.where(owned[sl], logits.gather(1, picked[sl].unsqueeze(1)).squeeze(1), 0.0)
        if entropy is not None:  # - sum p log p from the same chunk; padding columns (p = 0) give 0
            log_p = logits - lse[sl].unsqueeze(1)
            p = torch.exp(log_p)
            entropy[sl] = -torch.where(p > 0, p * log_p, 0.0).sum(dim=1)
    return lse, target_logit, entropy


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    tuning: KernelTuning,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p(target), lse, entropy or None), each [T] in the compute dtype."""
    lse, target_logit, entropy = shard_partials(
        hidden, weight, targets, weight.shape[0], tuning, with_entropy
    )
    return (target_logit - lse).clamp(max=0.0), lse, entropy


def _terms(logp: torch.Tensor, inputs: LossInputs, cfg: KernelLossConfig) -> TokenTerms:
    """`ppo_token_terms` of `logp` with the loss inputs in its dtype."""
    return ppo_token_terms(
        logp,
        inputs.old_logprobs.to(logp.dtype),
        inputs.behaviour_logprobs.to(logp.dtype),
        inputs.advantages.to(logp.dtype),
        inputs.action_mask,
        cfg,
    )


def loss_terms(logp: torch.Tensor, inputs: LossInputs, cfg: KernelLossConfig) -> tuple[torch.Tensor, ...]:
    """`ppo_token_terms` on detached log-probs, plus d loss_t / d logp_t by autograd."""
    leaf = logp.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        terms = _terms(leaf, inputs, cfg)
        (coef,) = torch.autograd.grad(terms.loss.sum(), leaf)
    return (
        terms.loss.detach(),
        coef,
        terms.is_weight,
        terms.clipped,
        terms.dual_clipped,
        terms.is_capped,
        terms.approx_kl,
    )


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inputs: LossInputs,
    cfg: KernelLossConfig,
    with_entropy: bool,
    tuning: KernelTuning,
) -> TokenForward:
    logp, lse, entropy = token_stats(hidden, weight, targets, with_entropy, tuning)
    return TokenForward(logp, lse, entropy, *loss_terms(logp, inputs, cfg))


def grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    tuning: KernelTuning,
    num_real: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """d hidden, d weight for d loss / d logprob = g, recomputing logits one token chunk at a time. num_real:
    only weight rows [0, num_real) are vocabulary (the rest, padding, is masked: its d weight is 0); a
    target of -1 (another shard's) adds no one-hot term."""
    dtype = compute_dtype(hidden.dtype)
    num_real = weight.shape[0] if num_real is None else num_real
    w = weight.to(dtype)
    grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
    owned, picked = _owned(targets)
    for sl in token_slices(hidden.shape[0], token_chunk_size(weight.shape[0], tuning)):
        h = hidden[sl].to(dtype)
        g_chunk = g[sl].to(dtype)
        logits = mask_columns(h @ w.T, num_real)
        dlogits = torch.exp(logits - lse[sl].to(dtype).unsqueeze(1)) * (-g_chunk).unsqueeze(1)
        rows = torch.arange(dlogits.shape[0], device=dlogits.device)
        dlogits[rows, picked[sl]] += torch.where(owned[sl], g_chunk, 0.0)
        grad_hidden[sl] = dlogits @ w
        grad_weight += dlogits.T @ h
    return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype)


def eager_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inputs: LossInputs,
    num_global_action_tokens: int,
    cfg: KernelLossConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused baseline: full [T, V] logits in the compute dtype, autograd end to end; (loss, logprobs)."""
    logits = (hidden @ weight.T).to(compute_dtype(hidden.dtype))
    logp = torch.log_softmax(logits, dim=1).gather(1, targets.long().unsqueeze(1)).squeeze(1)
    terms = _terms(logp, inputs, cfg)
    return terms.loss.sum() / float(num_global_action_tokens), logp.detach()
