"""Per-token entropy of the LM head's softmax from hidden states, with its gradient, never [T, V] logits.

    head_entropy(hidden [T, H], weight [V_r, H], num_real, reduce, token_chunk) -> H [T]

H_t = lse_t - sum_j p_tj x_tj over the vocabulary, x = hidden @ weight.T, p = softmax(x). The logits are
formed `token_chunk` tokens at a time in float32 (float64 for float64 inputs; the entropy is returned in
that dtype), in the forward and again
in the backward, whose gradient is d H_t / d x_tj = -p_tj (x_tj - lse_t + H_t).

Vocabulary-parallel heads: `weight` is this rank's shard; its rows from `num_real` on are padding (their
logits are masked out); `reduce` (None for an unsharded head) all-reduces an [T] tensor in place over the
shards, with op "max" or "sum" (three calls per forward: max, sum of exp, sum of p x). The hidden-state
gradient returned is this shard's part; the caller sums it over the shards (Megatron's
`copy_to_tensor_model_parallel_region` does). This is the torch path on every device: the Triton kernels
compute the entropy in their forward but have no entropy backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollart_hpc.kernels.common import compute_dtype, mask_columns, token_slices

Reduce = Callable[[torch.Tensor, str], torch.Tensor]


class _HeadEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        num_real: int,
        reduce: Reduce | None,
        token_chunk: int,
    ) -> torch.Tensor:
        dtype = compute_dtype(hidden.dtype)
        w = weight.to(dtype)
        n = hidden.shape[0]
        top = torch.full((n,), float("-inf"), dtype=dtype, device=hidden.device)
        for sl in token_slices(n, token_chunk):
            top[sl] = mask_columns(hidden[sl].to(dtype) @ w.T, num_real).amax(dim=1)
        if reduce is not None:
            reduce(top, "max")
        top = torch.where(torch.isfinite(top), top, 0.0)
        total, dot = torch.zeros_like(top), torch.zeros_like(top)
        for sl in token_slices(n, token_chunk):
            x = mask_columns(hidden[sl].to(dtype) @ w.T, num_real) - top[sl, None]
            e = torch.exp(x)
            total[sl] = e.sum(dim=1)
            dot[sl] = (e * torch.where(e > 0, x, 0.0)).sum(dim=1)
        if reduce is not None:
            reduce(total, "sum")
            reduce(dot, "sum")
        lse = top + torch.log(total)
        entropy = torch.log(total) - dot / total  # lse - sum p x, with x shifted by the max
        ctx.save_for_backward(hidden, weight, lse, entropy)
        ctx.num_real, ctx.token_chunk = num_real, token_chunk
        return entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, lse, entropy = ctx.saved_tensors
        dtype = lse.dtype
        w = weight.to(dtype)
        grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        g = grad.to(dtype)
        for sl in token_slices(hidden.shape[0], ctx.token_chunk):
            h = hidden[sl].to(dtype)
            log_p = mask_columns(h @ w.T, ctx.num_real) - lse[sl, None]
            p = torch.exp(log_p)
            dlogits = -p * (torch.where(p > 0, log_p, 0.0) + entropy[sl, None]) * g[sl, None]
            grad_hidden[sl] = dlogits @ w
            grad_weight += dlogits.T @ h
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None


def head_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    num_real: int | None = None,
    reduce: Reduce | None = None,
    token_chunk: int = 1024,
) -> torch.Tensor:
    """Entropy [T] of softmax(hidden @ weight.T) per token, differentiable w.r.t. hidden and
    weight; see the module docstring for `num_real` (default: every row) and `reduce`."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"need hidden [T, H] and weight [V, H], got {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    real = weight.shape[0] if num_real is None else max(0, min(num_real, weight.shape[0]))
    out: torch.Tensor = _HeadEntropy.apply(hidden, weight, real, reduce, max(1, token_chunk))
    return out
