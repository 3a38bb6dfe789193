"""Fused LM-head log-prob + SPO++ policy loss for the trainer: selector and autograd functions.

`fused_token_terms` takes the final hidden states of packed tokens (never the [T, V] logits) and returns
the per-token SPO++ terms of `token_loss.ppo_token_terms`, with the per-token loss differentiable w.r.t.
hidden states and LM-head weight; `fused_policy_loss` reduces them with `token_loss.reduce_token_terms`
(divided by the global action-token count) into the loss, log-probs (detached) and diagnostics. The
backward recomputes logits tile by tile (`lm_head_triton`) or chunk by chunk (`lm_head_reference`).

Implementations, keyed by name in `IMPLS`: "triton" and "torch". `impl="auto"` reads the override
`ROLLART_KERNEL_IMPL` (auto | triton | torch), then picks triton for CUDA tensors and torch otherwise.
Asking for triton on CPU tensors without `TRITON_INTERPRET=1` is an error, never a silent fallback.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, NamedTuple

import torch

from rollart_hpc.kernels.common import (
    KernelLossConfig,
    KernelTuning,
    LossInputs,
    TokenForward,
    check_loss_inputs,
    check_shapes,
)
from rollart_hpc.kernels.entropy import Reduce
from rollart_hpc.kernels.token_loss import LossDiagnostics, TokenTerms, reduce_token_terms

IMPLS: dict[str, str] = {
    "triton": "rollart_hpc.kernels.lm_head_triton",
    "torch": "rollart_hpc.kernels.lm_head_reference",
}
IMPL_ENV = "ROLLART_KERNEL_IMPL"


def resolve_impl(impl: str, device: torch.device) -> str:
    """The implementation name for `impl` (auto | triton | torch) on `device`; ValueError if unusable."""
    if impl == "auto":
        impl = os.environ.get(IMPL_ENV, "auto") or "auto"
        if impl not in ("auto", *IMPLS):
            raise ValueError(f"{IMPL_ENV}={impl!r}: expected one of auto, {', '.join(IMPLS)}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r}: expected one of auto, {', '.join(IMPLS)}")
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "impl 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return impl


def get_ops(impl: str, device: torch.device) -> ModuleType:
    return importlib.import_module(IMPLS[resolve_impl(impl, device)])


class _TokenLoss(torch.autograd.Function):
    """Per-token loss [T] (precomputed by the fused forward) -> d hidden, d weight via the recomputing
    backward: d loss / d logprob_t = coef_t, times the upstream gradient of loss_t."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        loss: torch.Tensor,
        targets: torch.Tensor,
        lse: torch.Tensor,
        coef: torch.Tensor,
        ops: ModuleType,
        tuning: KernelTuning,
    ) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight, targets, lse, coef)
        ctx.ops, ctx.tuning = ops, tuning
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, lse, coef = ctx.saved_tensors
        g = coef * grad_loss.to(coef.dtype)
        grad_hidden, grad_weight = ctx.ops.grads(hidden, weight, targets, lse, g, ctx.tuning)
        return grad_hidden, grad_weight, None, None, None, None, None, None


class _LinearLogprob(torch.autograd.Function):
    """(log p(target) [T], the softmax entropy [T] when asked (detached; else empty)) of hidden @ weight.T
    over the first `num_real` rows of `weight` (the rest is padding), from the backend's `shard_partials`,
    with its recomputing backward (`grads`) for any upstream gradient of the log-probs.

    With `reduce`, `weight` is one shard of a vocabulary-parallel head and `targets` index it (-1: another
    shard's target): the shards' log-sum-exps combine through `reduce` (a max, then a sum of rescaled
    exps), their target logits by a sum, and their entropies as that of the mixture of the shards'
    softmaxes, sum_r w_r (H_r - log w_r) with w_r = exp(lse_r - lse) (one more sum). The gradients are this
    shard's part: the caller sums that of the hidden states over the shards."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ops: ModuleType,
        tuning: KernelTuning,
        with_entropy: bool,
        num_real: int,
        reduce: Reduce | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_shapes(hidden, weight, targets)
        lse, target_logit, entropy = ops.shard_partials(
            hidden, weight, targets, num_real, tuning, with_entropy
        )
        if reduce is not None:
            shard_lse = lse
            top = reduce(lse.clone(), "max")
            lse = top + torch.log(reduce(torch.exp(lse - top), "sum"))
            reduce(target_logit, "sum")
            if entropy is not None:
                log_w = shard_lse - lse
                w = torch.exp(log_w)
                entropy = reduce(torch.where(w > 0, w * (entropy - log_w), 0.0), "sum")
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.ops, ctx.tuning, ctx.num_real = ops, tuning, num_real
        entropy = entropy if entropy is not None else lse.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        return (target_logit - lse).clamp(max=0.0), entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _grad_entropy: Any) -> tuple[Any, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden, grad_weight = ctx.ops.grads(
            hidden, weight, targets, lse, grad_logp.to(lse.dtype), ctx.tuning, ctx.num_real
        )
        return grad_hidden, grad_weight, None, None, None, None, None, None


def head_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    impl: str = "auto",
    tuning: KernelTuning | None = None,
    with_entropy: bool = False,
    num_real: int | None = None,
    reduce: Reduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target) [T], the entropy [T] detached when `with_entropy`, else empty) of the LM head
    `weight` [V, H], or of one shard of a vocabulary-parallel, padded head (`num_real`: the rows that are
    not padding, default all; `reduce`: the in-place all-reduce over the shards, as `entropy.head_entropy`
    takes it, with op "max" or "sum"); differentiable w.r.t. hidden and weight, never [T, V]."""
    ops = get_ops(impl, hidden.device)
    num_real = weight.shape[0] if num_real is None else num_real
    out: tuple[torch.Tensor, torch.Tensor] = _LinearLogprob.apply(
        hidden, weight, targets, ops, tuning or KernelTuning(), with_entropy, num_real, reduce
    )
    return out


def linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    impl: str = "auto",
    tuning: KernelTuning | None = None,
) -> torch.Tensor:
    """Per-token log p(target) of the LM head, differentiable w.r.t. hidden and weight, never [T, V]."""
    return head_logprob(hidden, weight, targets, impl, tuning)[0]


class FusedTokens(NamedTuple):
    """Per-token results [T] of the fused forward: SPO++ terms (`terms.loss` carries the gradient to hidden
    and weight; the rest is detached), log-probs (detached) and entropy (when asked for)."""

    terms: TokenTerms
    logprobs: torch.Tensor
    entropy: torch.Tensor | None


def fused_token_terms(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inputs: LossInputs,
    cfg: KernelLossConfig,
    impl: str = "auto",
    with_entropy: bool = False,
    tuning: KernelTuning | None = None,
) -> FusedTokens:
    """The per-token SPO++ terms of `hidden @ weight.T` [T, V] without materialising it; per-token
    inputs [T] (advantages already broadcast to tokens) are constants of the loss. Only token-level
    settings (`cfg.in_kernel`) are computed here; the others read trajectories (`token_loss`)."""
    if not cfg.in_kernel:
        raise ValueError(
            "sequence-level ratio, weight or rejection bounds: compute the terms with token_loss"
        )
    inputs = LossInputs(*(t.detach() for t in inputs))
    ops = get_ops(impl, hidden.device)
    tuning = tuning or KernelTuning()
    check_shapes(hidden, weight, targets)  # the backends' `forward` takes checked inputs
    check_loss_inputs(inputs, hidden.shape[0])
    with torch.no_grad():
        out: TokenForward = ops.forward(hidden, weight, targets, inputs, cfg, with_entropy, tuning)
    loss = _TokenLoss.apply(hidden, weight, out.loss, targets, out.lse, out.coef, ops, tuning)
    terms = TokenTerms(loss, out.is_weight, out.clipped, out.dual_clipped, out.is_capped, out.approx_kl, None)
    return FusedTokens(terms, out.logprobs, out.entropy)


def fused_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    action_mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    num_global_action_tokens: int,
    cfg: KernelLossConfig,
    impl: str = "auto",
    with_entropy: bool = False,
    tuning: KernelTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor, LossDiagnostics]:
    """SPO++ loss of packed tokens straight from hidden states [T, H] and the LM head [V, H].

    Per-token inputs are [T] (advantages already broadcast to tokens). Returns (loss with gradient to
    hidden and weight, log-probs [T] detached, diagnostics), reduced by `token_loss.reduce_token_terms`
    like the torch reference, so it equals that on the log-probs of `hidden @ weight.T` up to rounding.
    Token-mean aggregation without entropy or KL terms only: `rollart_hpc.algo.loss.policy_loss` takes
    the rest.
    """
    if cfg.loss_agg != "token_mean" or cfg.entropy_coef or cfg.kl_coef:
        raise ValueError("fused_policy_loss is the token-mean loss; use algo.loss.policy_loss for the others")
    inputs = LossInputs(action_mask, old_logprobs, behaviour_logprobs, advantages)
    fused = fused_token_terms(hidden, weight, targets, inputs, cfg, impl, with_entropy, tuning)
    loss, diagnostics = reduce_token_terms(
        fused.terms, action_mask, advantages, num_global_action_tokens, fused.entropy
    )
    return loss, fused.logprobs, diagnostics
