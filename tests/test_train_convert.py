"""HF <-> Megatron conversion: architecture mapping, bit-exact round trips, logit parity with transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from train_device import BACKEND, DEVICE, exact_fp32, tol

from rollart_hpc.models.checkpoint import expected_shapes, load_weights
from rollart_hpc.models.config import ModelConfig, config_from_dict
from rollart_hpc.train.convert import (
    from_stage,
    hf_to_megatron,
    megatron_args,
    megatron_to_hf,
    stage_layers,
    to_stage,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _raw(model_type: str = "llama", **extra: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "model_type": model_type,
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    }
    raw.update(extra)
    return raw


def _random_hf(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen) for k, shape in sorted(expected_shapes(cfg).items())}


def test_megatron_args_map_the_hf_config() -> None:
    args = megatron_args(config_from_dict(_raw("qwen2", tie_word_embeddings=True)))
    t, g = args.transformer, args.gpt
    assert (t["num_query_groups"], t["kv_channels"], t["ffn_hidden_size"]) == (2, 24, 96)
    assert t["layernorm_epsilon"] == 1e-5 and t["normalization"] == "RMSNorm" and t["add_qkv_bias"]
    assert t["gated_linear_unit"] and not t["add_bias_linear"]
    assert g["rotary_base"] == 500000 and g["share_embeddings_and_output_weights"] and g["vocab_size"] == 128
    assert not t["qk_layernorm"]
    assert not megatron_args(config_from_dict(_raw())).transformer["add_qkv_bias"]
    qwen3 = megatron_args(config_from_dict(_raw("qwen3"))).transformer
    assert qwen3["qk_layernorm"] and not qwen3["add_qkv_bias"] and qwen3["kv_channels"] == 24


def test_rope_scaling_maps_or_is_rejected() -> None:
    llama3 = LLAMA3_ROPE
    gpt = megatron_args(config_from_dict(_raw(rope_scaling=llama3))).gpt
    assert gpt["rope_scaling"] and gpt["rope_scaling_factor"] == 8.0
    linear = megatron_args(config_from_dict(_raw(rope_scaling={"rope_type": "linear", "factor": 2.0}))).gpt
    assert linear["seq_len_interpolation_factor"] == 2.0
    with pytest.raises(ValueError, match="high_freq_factor"):
        megatron_args(config_from_dict(_raw(rope_scaling={**llama3, "high_freq_factor": 2.0})))
    # Without original_max_position_embeddings transformers takes max_position_embeddings (here 16384),
    # where Megatron would compute with 8192.
    implicit = {k: v for k, v in llama3.items() if k != "original_max_position_embeddings"}
    with pytest.raises(ValueError, match="original_max_position_embeddings=16384"):
        megatron_args(config_from_dict(_raw(rope_scaling=implicit, max_position_embeddings=16384)))
    with pytest.raises(ValueError, match="integer"):
        megatron_args(config_from_dict(_raw(rope_theta=1e4 + 0.5)))


@pytest.mark.parametrize(
    "family,tied,rope",
    [
        ("llama", False, None),
        ("llama", True, None),
        ("llama", False, LLAMA3_ROPE),
        ("qwen2", True, None),
        ("qwen2", False, None),
        ("qwen3", True, None),
        ("qwen3", False, None),
    ],
)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_round_trip_is_bit_exact(family: str, tied: bool, rope: dict | None, tp: int, pp: int) -> None:
    """HF -> TP shards -> PP stages -> HF, both for the whole model and stage by stage (as published)."""
    extra = {"rope_scaling": rope} if rope else {}
    cfg = config_from_dict(_raw(family, tie_word_embeddings=tied, **extra))
    hf = _random_hf(cfg)
    shards = [hf_to_megatron(hf, cfg, tp_rank=r, tp_size=tp) for r in range(tp)]
    assert ("output_layer.weight" in shards[0]) != tied
    norms = [k for k in shards[0] if "layernorm.weight" in k and ".self_attention." in k]
    assert len(norms) == (2 * cfg.num_layers if family == "qwen3" else 0)
    for key in norms:  # q/k norms are replicated on every tensor-parallel rank
        assert all(torch.equal(s[key], shards[0][key]) for s in shards)
    stages = [stage_layers(cfg.num_layers, p, pp) for p in range(pp)]
    local = [
        [to_stage(s, layers, p == 0, p == pp - 1, tied) for s in shards] for p, layers in enumerate(stages)
    ]
    whole: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    per_stage: dict[str, torch.Tensor] = {}
    for p, layers in enumerate(stages):
        back_stage = [from_stage(s, layers, p == 0, tied) for s in local[p]]
        for r, s in enumerate(back_stage):
            whole[r].update(s)
        per_stage.update(megatron_to_hf(back_stage, cfg, layers))
    for back in (megatron_to_hf(whole, cfg), per_stage):
        assert set(back) == set(hf)
        assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_qkv_is_interleaved_per_group() -> None:
    cfg = config_from_dict(_raw())
    hf = _random_hf(cfg)
    qkv = hf_to_megatron(hf, cfg)["decoder.layers.0.self_attention.linear_qkv.weight"]
    hn, per_group = cfg.head_dim, (cfg.num_groups + 2) * cfg.head_dim
    q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(qkv[per_group : per_group + 2 * hn], q[2 * hn : 4 * hn])
    assert torch.equal(qkv[2 * hn : 3 * hn], k[:hn])


def test_te_norm_names_are_accepted() -> None:
    cfg = config_from_dict(_raw())
    hf = _random_hf(cfg)
    mg = hf_to_megatron(hf, cfg)
    renamed = {
        k.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight").replace(
            "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"
        ): v
        for k, v in mg.items()
    }
    back = megatron_to_hf([renamed], cfg)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    # One rank, no port. NCCL where the trainer runs on CUDA: Megatron's distributed optimizer gathers its
    # parameters with a coalesced all-gather that gloo does not implement for CUDA tensors (a segfault).
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _llama3_model(out: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, rope_parameters=rope, tie_word_embeddings=False,
        max_position_embeddings=16384,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def _model_dir(kind: str, out: Path) -> Path:
    from rollart_hpc.models.tiny import make_tiny_model

    if kind == "llama3-rope":
        return _llama3_model(out)
    family, tied = kind.split("-")
    theta = 500000.0 if family == "llama" else 1000000.0
    # head_dim 64 != hidden_size / num_heads (32): kv_channels must come from head_dim.
    return make_tiny_model(
        out, family=family, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        tie_word_embeddings=tied == "tied", rope_theta=theta, init_std=0.05,
    )  # fmt: skip


@pytest.mark.parametrize(
    "kind", ["llama-untied", "qwen2-tied", "qwen2-untied", "llama3-rope", "qwen3-tied", "qwen3-untied"]
)
def test_logits_match_transformers(kind: str, tmp_path: Path, one_rank_group: None) -> None:
    """The converted model on the trainer's device against transformers on the CPU, both in full fp32
    (TF32 off on CUDA for this comparison: it checks the conversion, not TF32's rounding)."""
    from transformers import AutoModelForCausalLM

    from rollart_hpc.train.model import ensure_model_parallel, gpt_from_hf

    folder = _model_dir(kind, tmp_path / kind)
    ensure_model_parallel(0)
    model, cfg = gpt_from_hf(folder, DEVICE)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), exact_fp32():
        # Megatron's vocabulary is padded to a multiple of 128 with zero rows: its real columns are HF's.
        padded, ref = model(ids.to(DEVICE), None, None).cpu(), hf(ids).logits
        ours = padded[..., : cfg.vocab_size]
        assert padded.shape[-1] % 128 == 0 and float(padded[..., cfg.vocab_size :].abs().sum()) == 0
        logprobs = torch.log_softmax(ours[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        bound = tol(1e-5)  # TF32 is off here: fp32's own
    assert float(ref.abs().max()) > 0.1
    # 1e-5: measured <= 6e-7; a llama3 model without its RoPE scaling is off by 4e-4 at 128 tokens.
    assert float((ours - ref).abs().max()) < bound
    ref_lp = torch.log_softmax(ref[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert float((logprobs - ref_lp).abs().max()) < bound
    state = {k: v.cpu() for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    back, orig = megatron_to_hf([state], cfg), load_weights(folder, cfg)
    assert set(back) == set(orig) and all(torch.equal(back[k], orig[k]) for k in orig)


def test_cpu_patches_are_idempotent_and_move_inline_cuda_tensors(one_rank_group: None) -> None:
    from megatron.core.transformer.utils import get_default_causal_mask

    from rollart_hpc.train.megatron_compat import apply_cpu_patches

    if torch.cuda.is_available():
        assert apply_cpu_patches() is False
        return
    assert apply_cpu_patches() is True
    type_fn = torch.Tensor.type
    assert apply_cpu_patches() is True and torch.Tensor.type is type_fn
    assert get_default_causal_mask(5).device.type == "cpu"
    assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(2).type(torch.float64).dtype == torch.float64
