"""The trainer's LM-head log-probs (`train.lm_head.head_logprobs`) from bf16 hidden states and weights:
fp32 accumulation and fp32 log-probs, gradients back in bf16; the Triton kernel on a padded head against the
torch path (interpreted on CPU; compiled on a GPU in the `gpu` test). TP 2: tests/test_train_lm_head_mpi.py."""

from __future__ import annotations

import os

import pytest
import torch

from rollart_hpc.train.lm_head import LMHead, head_logprobs, head_logprobs_entropy


@pytest.mark.parametrize("padding", [0, 24], ids=["fused-kernel", "padded-head"])
def test_bf16_inputs_give_fp32_logprobs_accumulated_in_fp32(padding: int) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 37, 256, 300
    hidden = torch.randn(tokens, hidden_size, generator=gen).bfloat16().requires_grad_(True)
    weight = (torch.randn(vocab + padding, hidden_size, generator=gen) * 0.2).bfloat16().requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    lp = head_logprobs(LMHead(vocab, tp_size=1, timeout_s=5.0), hidden, weight, targets)
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


def _logprobs_and_grads(
    impl: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp = head_logprobs(LMHead(vocab, tp_size=1, timeout_s=5.0, impl=impl), h, w, targets)
    (lp * torch.linspace(-1, 1, lp.shape[0])).sum().backward()
    assert h.grad is not None and w.grad is not None
    return lp.detach(), h.grad, w.grad


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on CPU tensors needs TRITON_INTERPRET=1"
)


@interpreted
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
def test_triton_kernel_on_a_padded_head_matches_the_torch_path(dtype: torch.dtype, tol: float) -> None:
    """TP 1, vocabulary 100 padded to 128 (Megatron's multiple of 128): the Triton kernel (interpreted)
    masks the padding rows itself; its log-probs and gradients equal the chunked torch path's, and the
    padding rows get no gradient."""
    gen = torch.Generator().manual_seed(3)
    tokens, hidden_size, vocab, padded = 19, 32, 100, 128
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(padded, hidden_size, generator=gen) * 0.3).to(dtype)
    weight[vocab:] = 50.0  # padding rows whose logits would dominate the softmax if they were not masked
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[0] = vocab - 1
    lp_k, gh_k, gw_k = _logprobs_and_grads("triton", hidden, weight, targets, vocab)
    lp_t, gh_t, gw_t = _logprobs_and_grads("torch", hidden, weight, targets, vocab)
    assert lp_k.dtype == torch.float32 and gh_k.dtype == gw_k.dtype == dtype
    assert _rel(lp_k, lp_t) < tol and _rel(gh_k, gh_t) < tol and _rel(gw_k, gw_t) < tol
    assert bool((gw_k[vocab:] == 0).all()) and bool((gw_t[vocab:] == 0).all())
    assert float(lp_t.max()) < 0 and float(lp_t.min()) > -30  # padding masked: no log-prob near -50 * |h|


@interpreted
def test_auto_picks_the_kernel_when_asked_and_torch_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU "auto" is the torch path; ROLLART_KERNEL_IMPL=triton (as CUDA picks by default) runs the
    kernel on a padded head."""
    import rollart_hpc.kernels.lm_head_triton as triton_ops

    calls: list[int] = []
    real = triton_ops.shard_partials

    def spy(*args: object) -> object:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_ops, "shard_partials", spy)
    hidden, weight = torch.randn(5, 16), torch.randn(24, 16)
    targets = torch.tensor([0, 3, 19, 7, 1])
    head_logprobs(LMHead(20, tp_size=1, timeout_s=5.0), hidden, weight, targets)
    assert calls == []
    monkeypatch.setenv("ROLLART_KERNEL_IMPL", "triton")
    head_logprobs(LMHead(20, tp_size=1, timeout_s=5.0), hidden, weight, targets)
    assert calls == [1]


@pytest.mark.parametrize("padding", [0, 24], ids=["fused-kernel", "padded-head"])
@pytest.mark.parametrize(
    "impl",
    ["torch", pytest.param("triton", marks=interpreted)],
)
def test_entropy_from_the_logprob_pass_is_the_exact_entropy_and_leaves_the_logprobs(
    impl: str, padding: int
) -> None:
    """`head_logprobs_entropy`: the softmax entropy over the real rows (padding masked) from the same logit
    chunks as the log-probs, detached; its log-probs and their gradients are `head_logprobs`' exactly."""
    gen = torch.Generator().manual_seed(7)
    tokens, hidden_size, vocab = 23, 32, 100
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    weight = torch.randn(vocab + padding, hidden_size, generator=gen) * 0.3
    weight[vocab:] = 50.0  # padding rows that would dominate the softmax unmasked
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    logits = hidden.double() @ weight.double()[:vocab].T
    want = -(torch.softmax(logits, 1) * torch.log_softmax(logits, 1)).sum(1)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, entropy = head_logprobs_entropy(LMHead(vocab, tp_size=1, timeout_s=5.0, impl=impl), h, w, targets)
    assert entropy.dtype == torch.float32 and not entropy.requires_grad
    assert float((entropy.double() - want).abs().max()) < 1e-5
    (lp * torch.linspace(-1, 1, tokens)).sum().backward()
    lp_ref, gh_ref, gw_ref = _logprobs_and_grads(impl, hidden, weight, targets, vocab)
    assert torch.equal(lp.detach(), lp_ref)
    assert h.grad is not None and w.grad is not None
    assert torch.equal(h.grad, gh_ref) and torch.equal(w.grad, gw_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_padded_qwen_shard_kernel_matches_torch() -> None:
    """Compiled Triton on one GPU, bf16: the last shard of Qwen2.5's head at TP 4 (vocabulary 151,936
    padded to 152,064; 38,016 rows of which the last 192 are padding), through the path "auto" takes on CUDA,
    against the torch path. (TP 2 across two ranks needs two GPUs: tests/test_train_lm_head_mpi.py.)"""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("run with TRITON_INTERPRET=0 (scripts/gpu_check.sh does)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden_size, rows, real = 2048, 4096, 38016, 37824
    hidden = torch.randn(tokens, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(rows, hidden_size, device="cuda", generator=gen) * hidden_size**-0.5).bfloat16()
    weight[real:] = 1.0  # padding rows with the largest logits: they must be masked
    targets = torch.randint(0, real, (tokens,), device="cuda", generator=gen)
    upstream = torch.linspace(-1, 1, tokens, device="cuda")
    results = {}
    for impl in ("auto", "torch"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp = head_logprobs(LMHead(real, tp_size=1, timeout_s=60.0, impl=impl), h, w, targets)
        (lp * upstream).sum().backward()
        assert h.grad is not None and w.grad is not None
        results[impl] = (lp.detach(), h.grad, w.grad)
    for got, want in zip(results["auto"], results["torch"], strict=True):
        assert _rel(got, want) < 2e-2
    assert bool((results["auto"][2][real:] == 0).all())
