"""Fused LM-head log-prob + SPO++ policy loss for the trainer: selector and autograd functions.

`fused_policy_loss` takes the final hidden states of packed tokens (never the [T, V] logits) and returns
the token-mean SPO++ loss of `rollart_hpc.algo.loss` (same per-token terms, divided by the global
action-token count), the per-token log-probs (detached) and diagnostics summed the same way. The
backward recomputes logits tile by tile (`lm_head_triton`) or chunk by chunk (`lm_head_reference`).

Implementations, keyed by name in `IMPLS`: "triton" and "torch". `impl="auto"` reads the override
`ROLLART_KERNEL_IMPL` (auto | triton | torch), then picks triton for CUDA tensors and torch otherwise.
Asking for triton on CPU tensors without `TRITON_INTERPRET=1` is an error, never a silent fallback.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from rollart_hpc.kernels.common import KernelTuning, LossInputs, TokenForward

from rollart_hpc.algo.loss import LossConfig

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


class _LossFromTokens(torch.autograd.Function):
    """loss (precomputed by the fused forward) -> d hidden, d weight via the recomputing backward."""

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
    """log p(target) [T] of hidden @ weight.T, with the recomputing backward for any upstream gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ops: ModuleType,
        tuning: KernelTuning,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        zeros = torch.zeros(num_tokens, dtype=torch.float32, device=hidden.device)
        inputs = LossInputs(zeros.to(torch.bool), zeros, zeros, zeros)
        out = ops.forward(hidden, weight, targets, inputs, LossConfig(), False, tuning)
        ctx.save_for_backward(hidden, weight, targets, out.lse)
        ctx.ops, ctx.tuning = ops, tuning
        return out.logprobs

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden, grad_weight = ctx.ops.grads(
            hidden, weight, targets, lse, grad_logp.to(lse.dtype), ctx.tuning
        )
        return grad_hidden, grad_weight, None, None, None


def linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    impl: str = "auto",
    tuning: KernelTuning | None = None,
) -> torch.Tensor:
    """Per-token log p(target) of the LM head, differentiable w.r.t. hidden and weight, never [T, V]."""
    ops = get_ops(impl, hidden.device)
    out: torch.Tensor = _LinearLogprob.apply(hidden, weight, targets, ops, tuning or KernelTuning())
    return out


@dataclass(frozen=True)
class FusedDiagnostics:
    """Detached diagnostics of one micro-batch, divided by the global action-token count like the loss
    (sum them over micro-batches and ranks; take the max of `max_abs_advantage`). `entropy` is the summed
    action-token entropy / denominator and `token_entropy` the per-token entropy [T], when asked for."""

    approx_kl: torch.Tensor
    clip_fraction: torch.Tensor
    dual_clip_fraction: torch.Tensor
    is_capped_fraction: torch.Tensor
    max_abs_advantage: torch.Tensor
    num_action_tokens: int
    entropy: torch.Tensor | None = None
    token_entropy: torch.Tensor | None = None


def _diagnostics(out: TokenForward, inputs: LossInputs, denom: float) -> FusedDiagnostics:
    mask = inputs.action_mask.bool()
    abs_adv = torch.where(mask, inputs.advantages.detach().abs().to(out.loss.dtype), 0.0)
    entropy = None
    if out.entropy is not None:
        entropy = torch.where(mask, out.entropy, 0.0).sum() / denom
    return FusedDiagnostics(
        approx_kl=out.approx_kl.sum() / denom,
        clip_fraction=out.clipped.sum() / denom,
        dual_clip_fraction=out.dual_clipped.sum() / denom,
        is_capped_fraction=out.is_capped.sum() / denom,
        max_abs_advantage=abs_adv.max() if abs_adv.numel() else abs_adv.sum(),
        num_action_tokens=int(mask.sum()),
        entropy=entropy,
        token_entropy=out.entropy,
    )


def fused_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    action_mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    num_global_action_tokens: int,
    cfg: LossConfig,
    impl: str = "auto",
    with_entropy: bool = False,
    tuning: KernelTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor, FusedDiagnostics]:
    """SPO++ loss of packed tokens straight from hidden states [T, H] and the LM head [V, H].

    Per-token inputs are [T] (advantages already broadcast to tokens). Returns (loss with gradient to
    hidden and weight, log-probs [T] detached, diagnostics). Equals `packed_policy_loss` on the
    log-probs of `hidden @ weight.T`, up to floating-point rounding.
    """
    inputs = LossInputs(action_mask, old_logprobs.detach(), behaviour_logprobs.detach(), advantages.detach())
    num_local = int(action_mask.bool().sum())
    if num_global_action_tokens < max(num_local, 1):
        raise ValueError(
            f"num_global_action_tokens {num_global_action_tokens} < this batch's {num_local} (or 0)"
        )
    ops = get_ops(impl, hidden.device)
    tuning = tuning or KernelTuning()
    with torch.no_grad():
        out: TokenForward = ops.forward(hidden, weight, targets, inputs, cfg, with_entropy, tuning)
    denom = float(num_global_action_tokens)
    loss_value = out.loss.sum() / denom
    loss = _LossFromTokens.apply(hidden, weight, loss_value, targets, out.lse, out.coef / denom, ops, tuning)
    return loss, out.logprobs, _diagnostics(out, inputs, denom)
