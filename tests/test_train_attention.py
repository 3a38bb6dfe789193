"""Core attention and activation recomputation of the trainer's GPTModel, on one rank on the trainer's
device (tests/train_device.py: the CPU with gloo, or CUDA with NCCL and TF32 tolerances), fp32.

`sdpa` against Megatron's unfused attention: the loss and every parameter gradient agree (GQA, bias,
right-padded rows of unequal lengths, an explicit mask, packed sequences); each recompute mode gives the
gradients of no recomputation, and really recomputes (forward calls counted).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from train_device import BACKEND, DEVICE, assert_close, tol

from rollart_hpc.models.config import ModelConfig
from rollart_hpc.train.batch import from_sequences, to_padded_rows

CFG = ModelConfig(
    model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
    tie_word_embeddings=False, qkv_bias=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def weights() -> Iterator[dict[str, torch.Tensor]]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rollart_hpc.train.model import build_gpt, ensure_model_parallel

    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port
    ensure_model_parallel(seed=0)
    gen = torch.Generator().manual_seed(1)
    state = build_gpt(CFG, DEVICE, attention="unfused").state_dict()
    yield {
        k: (torch.randn(v.shape, generator=gen) * 0.1 + (1.0 if k.endswith("layernorm.weight") else 0.0)).to(
            DEVICE
        )
        for k, v in state.items()
        if not k.endswith("._extra_state")
    }
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _model(weights: dict[str, torch.Tensor], attention: str, recompute: str = "none") -> Any:
    from rollart_hpc.train.model import build_gpt, load_megatron_weights

    model = build_gpt(CFG, DEVICE, attention=attention, recompute=recompute)
    load_megatron_weights(model, weights)
    return model.train()


def _rows() -> Any:
    """Right-padded rows of three sequences of unequal lengths, as the trainer builds them."""
    gen = torch.Generator().manual_seed(0)
    lengths = [37, 12, 25]
    tokens = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    masks = [[0] + [1] * (n - 1) for n in lengths]
    zeros = [[0.0] * n for n in lengths]
    return to_padded_rows(from_sequences(tokens, masks, zeros, zeros))


def _loss_and_grads(model: Any) -> tuple[float, dict[str, torch.Tensor]]:
    rows = _rows()
    ids, targets, valid = (t.to(DEVICE) for t in (rows.input_ids, rows.targets, rows.target_valid))
    logits = model(ids, None, None)  # [b, s, V]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss = -(logp * valid).sum() / valid.sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_close(
    got: tuple[float, dict[str, torch.Tensor]], ref: tuple[float, dict[str, torch.Tensor]], tol: float
) -> None:
    assert abs(got[0] - ref[0]) <= tol * abs(ref[0])
    assert got[1].keys() == ref[1].keys()
    for name, grad in ref[1].items():
        err = float((got[1][name] - grad).abs().max() / grad.abs().max())
        assert err <= tol, f"{name}: relative gradient error {err:.2e}"


def _count_calls(modules: list[torch.nn.Module]) -> list[int]:
    counts = [0]

    def hook(*_: Any) -> None:
        counts[0] += 1

    for module in modules:
        module.register_forward_hook(hook)
    return counts


@pytest.mark.parametrize("native_gqa", [True, False])
def test_sdpa_matches_the_unfused_attention_in_loss_and_every_gradient(
    weights: dict[str, torch.Tensor], native_gqa: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Key/value groups taken natively by SDPA (CPU) or repeated per query head (CUDA fp32, masks)."""
    from rollart_hpc.train import attention
    from rollart_hpc.train.attention import SdpaAttention

    if native_gqa and DEVICE.type == "cuda":
        pytest.skip("on CUDA SDPA's fused kernels take grouped heads natively in bf16/fp16 only")
    monkeypatch.setattr(attention, "native_gqa", lambda query, mask: native_gqa)

    sdpa = _model(weights, "sdpa")
    unfused = _model(weights, "unfused")
    assert all(
        isinstance(layer.self_attention.core_attention, SdpaAttention) for layer in sdpa.decoder.layers
    )
    assert not any(isinstance(m, SdpaAttention) for m in unfused.modules())
    _assert_close(_loss_and_grads(sdpa), _loss_and_grads(unfused), tol(1e-5))


@pytest.mark.parametrize("attention", ["sdpa", "unfused"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_gradients_of_no_recompute(
    weights: dict[str, torch.Tensor], attention: str, recompute: str
) -> None:
    ref = _loss_and_grads(_model(weights, attention))
    model = _model(weights, attention, recompute)
    layers = list(model.decoder.layers)
    attention_calls = _count_calls([layer.self_attention.core_attention for layer in layers])
    mlp_calls = _count_calls([layer.mlp for layer in layers])
    _assert_close(_loss_and_grads(model), ref, tol(1e-6))
    # Forward and backward: the recomputed modules ran twice per layer, the others once.
    assert attention_calls[0] == 2 * len(layers)
    assert mlp_calls[0] == (2 if recompute == "full" else 1) * len(layers)


def _core(attention: str, weights: dict[str, torch.Tensor]) -> Any:
    return _model(weights, attention).decoder.layers[0].self_attention.core_attention


def _qkv(s: int, b: int, requires_grad: bool = True) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    heads = [CFG.num_heads, CFG.num_kv_heads, CFG.num_kv_heads]
    shapes = [(s, b, n, CFG.head_dim) for n in heads]
    return [torch.randn(x, generator=gen).to(DEVICE).requires_grad_(requires_grad) for x in shapes]


def _grads_of(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    weight = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    return list(torch.autograd.grad((out * weight).sum(), inputs))


def test_an_explicit_mask_is_applied_as_megatron_applies_it(weights: dict[str, torch.Tensor]) -> None:
    s, b = 9, 2
    mask = torch.rand(b, 1, s, s, generator=torch.Generator().manual_seed(4)) < 0.4
    mask = (mask & ~torch.eye(s, dtype=torch.bool)).to(DEVICE)  # every query keeps at least one key
    outs = []
    for attention in ("sdpa", "unfused"):
        q, k, v = _qkv(s, b)
        out = _core(attention, weights)(q, k, v, mask)
        assert out.shape == (s, b, CFG.num_heads * CFG.head_dim)
        outs.append([out.detach(), *_grads_of(out, [q, k, v])])
    for got, ref in zip(*outs, strict=True):
        assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_packed_sequences_attend_within_their_own_sequence(weights: dict[str, torch.Tensor]) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    core = _core("sdpa", weights)
    lengths = [5, 11, 3]
    cu = torch.tensor([0, 5, 16, 19], dtype=torch.int32, device=DEVICE)
    q, k, v = (t.squeeze(1) for t in _qkv(sum(lengths), 1, requires_grad=False))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    packed = core(q, k, v, None, packed_seq_params=params)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = core(q[lo:hi, None], k[lo:hi, None], v[lo:hi, None], None)
        assert_close(packed[lo:hi], alone[:, 0], rtol=1e-6, atol=1e-6)


def test_unsupported_settings_are_refused(weights: dict[str, torch.Tensor]) -> None:
    core = _core("sdpa", weights)
    q, k, v = _qkv(4, 1, requires_grad=False)
    with pytest.raises(ValueError, match="attention bias"):
        core(q, k, v, None, attention_bias=torch.zeros(1, device=DEVICE))
    with pytest.raises(TypeError, match="boolean"):
        core(q, k, v, torch.zeros(1, 1, 4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="attention must be one of"):
        from rollart_hpc.train.attention import local_layer_spec

        local_layer_spec("flash")
