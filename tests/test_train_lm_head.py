"""The trainer's LM-head log-probs (`train.lm_head.head_logprobs`) from bf16 hidden states and weights:
fp32 accumulation and fp32 log-probs, gradients back in bf16."""

from __future__ import annotations

import pytest
import torch

from rollart_hpc.train.lm_head import head_logprobs


@pytest.mark.parametrize("padding", [0, 24], ids=["fused-kernel", "padded-head"])
def test_bf16_inputs_give_fp32_logprobs_accumulated_in_fp32(padding: int) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 37, 256, 300
    hidden = torch.randn(tokens, hidden_size, generator=gen).bfloat16().requires_grad_(True)
    weight = (torch.randn(vocab + padding, hidden_size, generator=gen) * 0.2).bfloat16().requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    lp = head_logprobs(hidden, weight, targets, vocab, tp_size=1, timeout_s=5.0)
    assert lp.dtype == torch.float32
    # The exact log-probs of the same bf16 values; a bf16 product would be off by ~1e-2 at this width.
    h64, w64 = hidden.detach().double(), weight.detach().double()[:vocab]
    ref = torch.log_softmax(h64 @ w64.T, dim=1).gather(1, targets[:, None])[:, 0]
    assert float((lp.double() - ref).abs().max()) < 1e-4
    (lp * torch.linspace(-1, 1, tokens)).sum().backward()
    assert hidden.grad is not None and weight.grad is not None
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    h, w = h64.clone().requires_grad_(True), weight.detach().double().requires_grad_(True)
    logits = (h @ w.T).index_fill(1, torch.arange(vocab, vocab + padding), float("-inf"))
    exact = torch.log_softmax(logits, dim=1).gather(1, targets[:, None])[:, 0]
    (exact * torch.linspace(-1, 1, tokens, dtype=torch.float64)).sum().backward()
    assert h.grad is not None and w.grad is not None
    for got, want in ((hidden.grad, h.grad), (weight.grad, w.grad)):
        assert float((got.double() - want).norm() / want.norm()) < 1e-2
