"""Torch reference of the fused LM-head log-prob + policy loss: chunked over tokens, any device.

Same operations as `lm_head_triton` (see `common`): logits are computed for `token_chunk` tokens at a
time in float32 (float64 for float64 inputs), so memory is O(token_chunk * V), never [T, V]. The
per-token loss terms come from `token_loss.ppo_token_terms` itself (the function the training loss
uses), and d loss / d logprob from autograd through it, so this path equals the training reference by
construction.

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
    check_loss_inputs,
    check_shapes,
)
from rollart_hpc.kernels.token_loss import ppo_token_terms

LOGITS_BUDGET_ELEMENTS = 1 << 24  # 64 MiB of float32 logits per chunk


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_chunk_size(num_vocab: int, tuning: KernelTuning) -> int:
    if tuning.token_chunk is not None:
        return tuning.token_chunk
    return max(1, LOGITS_BUDGET_ELEMENTS // max(num_vocab, 1))


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    tuning: KernelTuning,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p(target), lse, entropy or None), each [T] in the compute dtype."""
    dtype = compute_dtype(hidden.dtype)
    w = weight.to(dtype)
    num_tokens = hidden.shape[0]
    logp = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    chunk = token_chunk_size(weight.shape[0], tuning)
    for start in range(0, num_tokens, chunk):
        sl = slice(start, min(start + chunk, num_tokens))
        logits = hidden[sl].to(dtype) @ w.T
        lse[sl] = torch.logsumexp(logits, dim=1)
        target_logit = logits.gather(1, targets[sl].long().unsqueeze(1)).squeeze(1)
        logp[sl] = (target_logit - lse[sl]).clamp(max=0.0)
        if entropy is not None:  # - sum p log p, from the same chunk of logits
            log_p = logits - lse[sl].unsqueeze(1)
            entropy[sl] = -(torch.exp(log_p) * log_p).sum(dim=1)
    return logp, lse, entropy


def loss_terms(logp: torch.Tensor, inputs: LossInputs, cfg: KernelLossConfig) -> tuple[torch.Tensor, ...]:
    """`ppo_token_terms` on detached log-probs, plus d loss_t / d logp_t by autograd."""
    leaf = logp.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        terms = ppo_token_terms(
            leaf,
            inputs.old_logprobs.to(leaf.dtype),
            inputs.behaviour_logprobs.to(leaf.dtype),
            inputs.advantages.to(leaf.dtype),
            inputs.action_mask,
            cfg,
        )
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
    check_shapes(hidden, weight, targets)
    check_loss_inputs(inputs, hidden.shape[0])
    logp, lse, entropy = token_stats(hidden, weight, targets, with_entropy, tuning)
    return TokenForward(logp, lse, entropy, *loss_terms(logp, inputs, cfg))


def grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    tuning: KernelTuning,
) -> tuple[torch.Tensor, torch.Tensor]:
    """d hidden, d weight for d loss / d logprob = g, recomputing logits one token chunk at a time."""
    dtype = compute_dtype(hidden.dtype)
    w = weight.to(dtype)
    grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
    chunk = token_chunk_size(weight.shape[0], tuning)
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, min(start + chunk, hidden.shape[0]))
        h = hidden[sl].to(dtype)
        g_chunk = g[sl].to(dtype)
        dlogits = torch.exp(h @ w.T - lse[sl].to(dtype).unsqueeze(1)) * (-g_chunk).unsqueeze(1)
        rows = torch.arange(dlogits.shape[0], device=dlogits.device)
        dlogits[rows, targets[sl].long()] += g_chunk
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
    terms = ppo_token_terms(
        logp,
        inputs.old_logprobs.to(logp.dtype),
        inputs.behaviour_logprobs.to(logp.dtype),
        inputs.advantages.to(logp.dtype),
        inputs.action_mask,
        cfg,
    )
    return terms.loss.sum() / float(num_global_action_tokens), logp.detach()
