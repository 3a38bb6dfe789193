"""HF <-> Megatron-core (local layer spec) weights and architecture arguments for Llama and Qwen2.

HF names are those of `rollart_hpc.models.checkpoint` (a tied head has no `lm_head.weight`). Megatron
names are those of `GPTModel.state_dict()` with the local spec; `megatron_to_hf` also accepts the
Transformer-Engine names of the fused norms (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).

Invariants: HF -> Megatron -> HF is bit-exact (only views, slices and concatenations); the q/k/v rows are
interleaved per query group `[q heads of g; k_g; v_g]`; fc1 is `cat([gate, up])` per tensor-parallel rank;
RoPE needs no row permutation (Megatron's rotate-half equals HF's). Tensor parallelism: column-parallel
weights (qkv, fc1, embedding, output layer) are split on dim 0, row-parallel ones (proj, fc2) on dim 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from rollart_hpc.models.config import ModelConfig

# Megatron's llama3 RoPE scaling hard-codes these HF parameters.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
EMBED, FINAL_NORM, OUTPUT = (
    "embedding.word_embeddings.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
)
HF_EMBED, HF_NORM, HF_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
# Norm weights: local-spec name -> Transformer-Engine (fused) name, relative to decoder.layers.{i}.
NORM_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@dataclass(frozen=True)
class MegatronArgs:
    """Keyword arguments for `TransformerConfig(**transformer)` and `GPTModel(config, spec, **gpt)`."""

    transformer: dict[str, Any]
    gpt: dict[str, Any]


def _rope_args(cfg: ModelConfig) -> dict[str, Any]:
    scaling = dict(cfg.rope_scaling)
    rope_type = scaling.pop("rope_type", "default")
    if rope_type == "default":
        return {}
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return {"seq_len_interpolation_factor": factor}
    for key, expected in LLAMA3_FIXED.items():
        if float(scaling.get(key, expected)) != expected:
            raise ValueError(f"llama3 RoPE {key}={scaling[key]} is not supported (Megatron fixes {expected})")
    return {"rope_scaling": True, "rope_scaling_factor": factor}


def megatron_args(cfg: ModelConfig, tensor_parallel: int = 1) -> MegatronArgs:
    """The HF config mapped to TransformerConfig / GPTModel arguments (fp32, no fusions, no dropout)."""
    if cfg.rope_theta != int(cfg.rope_theta):
        raise ValueError(f"rope_theta {cfg.rope_theta} must be an integer (Megatron's rotary_base is an int)")
    transformer = {
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_query_groups": cfg.num_kv_heads,
        "kv_channels": cfg.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": cfg.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": cfg.qkv_bias,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "tensor_model_parallel_size": tensor_parallel,
    }
    gpt = {
        "vocab_size": cfg.vocab_size,
        "max_sequence_length": cfg.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": int(cfg.rope_theta),
        "share_embeddings_and_output_weights": cfg.tie_word_embeddings,
        **_rope_args(cfg),
    }
    return MegatronArgs(transformer, gpt)


def qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q/k/v (weights [.., H] or biases) -> Megatron's per-group interleaved linear_qkv."""
    ng, hn, rest = cfg.num_kv_heads, cfg.head_dim, q.shape[1:]
    parts = [q.view(ng, cfg.num_groups * hn, *rest), k.view(ng, hn, *rest), v.view(ng, hn, *rest)]
    return torch.cat(parts, 1).reshape(-1, *rest)


def qkv_split(w: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `qkv_fuse` for the whole (unsharded) tensor."""
    ng, hn, rest = cfg.num_kv_heads, cfg.head_dim, w.shape[1:]
    q, k, v = torch.split(w.view(ng, (cfg.num_groups + 2) * hn, *rest), [cfg.num_groups * hn, hn, hn], 1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _check_tp(cfg: ModelConfig, tp_size: int) -> None:
    if tp_size < 1 or cfg.num_kv_heads % tp_size or cfg.vocab_size % tp_size:
        raise ValueError(
            f"tensor parallel size {tp_size} must divide num_kv_heads {cfg.num_kv_heads} "
            f"and vocab_size {cfg.vocab_size}"
        )


def _layer_to_megatron(hf: dict[str, torch.Tensor], cfg: ModelConfig, i: int, rank: int, tp: int) -> dict:
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn = h + "self_attn."
    out = {
        m + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
        m + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
        m + "self_attention.linear_proj.weight": hf[attn + "o_proj.weight"].chunk(tp, 1)[rank],
        m + "mlp.linear_fc2.weight": hf[h + "mlp.down_proj.weight"].chunk(tp, 1)[rank],
    }
    gate, up = (
        hf[h + "mlp.gate_proj.weight"].chunk(tp, 0)[rank],
        hf[h + "mlp.up_proj.weight"].chunk(tp, 0)[rank],
    )
    out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
    kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    for kind in kinds:
        q, k, v = (hf[f"{attn}{p}_proj.{kind}"] for p in "qkv")
        out[f"{m}self_attention.linear_qkv.{kind}"] = qkv_fuse(q, k, v, cfg).chunk(tp, 0)[rank]
    return out


def hf_to_megatron(
    hf: dict[str, torch.Tensor], cfg: ModelConfig, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """HF weights (tied head already dropped) -> the local-spec state dict of tensor-parallel rank `tp_rank`."""
    _check_tp(cfg, tp_size)
    out = {
        EMBED: hf[HF_EMBED].chunk(tp_size, 0)[tp_rank],
        FINAL_NORM: hf[HF_NORM],
    }
    if not cfg.tie_word_embeddings:
        out[OUTPUT] = hf[HF_HEAD].chunk(tp_size, 0)[tp_rank]
    for i in range(cfg.num_layers):
        out.update(_layer_to_megatron(hf, cfg, i, tp_rank, tp_size))
    return {k: v.contiguous() for k, v in out.items()}


def _norm(shard: dict[str, torch.Tensor], prefix: str, local_name: str) -> torch.Tensor:
    local = prefix + local_name
    return shard[local] if local in shard else shard[prefix + NORM_ALIASES[local_name]]


def _layer_to_hf(shards: list[dict[str, torch.Tensor]], cfg: ModelConfig, i: int) -> dict[str, torch.Tensor]:
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn = h + "self_attn."
    out = {
        h + "input_layernorm.weight": _norm(shards[0], m, "input_layernorm.weight"),
        h + "post_attention_layernorm.weight": _norm(shards[0], m, "pre_mlp_layernorm.weight"),
        attn + "o_proj.weight": torch.cat([s[m + "self_attention.linear_proj.weight"] for s in shards], 1),
        h + "mlp.down_proj.weight": torch.cat([s[m + "mlp.linear_fc2.weight"] for s in shards], 1),
    }
    halves = [s[m + "mlp.linear_fc1.weight"].chunk(2, 0) for s in shards]
    out[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves], 0)
    out[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in halves], 0)
    kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    for kind in kinds:
        fused = torch.cat([s[f"{m}self_attention.linear_qkv.{kind}"] for s in shards], 0)
        for name, tensor in zip("qkv", qkv_split(fused, cfg), strict=True):
            out[f"{attn}{name}_proj.{kind}"] = tensor
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Megatron state dicts of all tensor-parallel ranks, in rank order -> HF weights (no tied lm_head)."""
    _check_tp(cfg, len(shards))
    out = {
        HF_EMBED: torch.cat([s[EMBED] for s in shards], 0),
        HF_NORM: shards[0][FINAL_NORM],
    }
    if not cfg.tie_word_embeddings:
        out[HF_HEAD] = torch.cat([s[OUTPUT] for s in shards], 0)
    for i in range(cfg.num_layers):
        out.update(_layer_to_hf(shards, cfg, i))
    return {k: v.contiguous() for k, v in out.items()}
