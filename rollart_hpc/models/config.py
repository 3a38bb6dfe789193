"""The decoder's architecture, read from an HF `config.json` (Llama, Qwen2 and Qwen3 families). Torch-free.

Qwen3 differs from Qwen2 by a per-head RMSNorm of queries and keys (`q_norm`, `k_norm`, applied before
RoPE), no q/k/v bias, and an explicit `head_dim` that may differ from hidden_size / num_heads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# model_type -> whether q/k/v projections carry a bias (Qwen2 always does, Qwen3 never; Llama follows
# attention_bias).
FAMILY_QKV_BIAS: dict[str, bool | None] = {"llama": None, "qwen2": True, "qwen3": False}
# model_type -> the causal-LM architecture name config.json lists for it.
FAMILY_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Families whose attention normalises each query and key head (RMSNorm over head_dim) before RoPE.
QK_NORM_FAMILIES = ("qwen3",)
# model_type -> head_dim when config.json omits it (transformers' config class default; None: hidden / heads).
DEFAULT_HEAD_DIM: dict[str, int | None] = {"llama": None, "qwen2": None, "qwen3": 128}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# rope_type -> the scaling parameters it needs (as transformers requires them).
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs; derived once from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        missing = [key for key in ROPE_KEYS[rope_type] if self.rope_scaling.get(key) is None]
        if missing:
            raise ValueError(f"rope_type {rope_type!r} needs rope parameter {missing[0]!r}")

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads


def _eos_ids(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    if isinstance(raw, int):
        return (raw,)
    return tuple(int(x) for x in raw)


def _max_positions(raw: dict[str, Any]) -> int:
    return int(raw.get("max_position_embeddings", 2048))


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling parameters) from either transformers-5 `rope_parameters` or older fields."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    if merged.get("rope_type") == "llama3":
        # As transformers: a top-level original_max_position_embeddings wins, else max_position_embeddings.
        if "original_max_position_embeddings" in raw:
            merged["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        else:
            merged.setdefault("original_max_position_embeddings", _max_positions(raw))
    return theta, merged


def _check_architecture(raw: dict[str, Any], model_type: str) -> None:
    """config.json's `architectures`, when listed, must be the family's causal-LM class."""
    expected = FAMILY_ARCHITECTURE[model_type]
    for name in raw.get("architectures") or ():
        if name != expected:
            raise ValueError(
                f"architecture {name!r} is not supported for {model_type} (supported: {expected})"
            )


def config_from_dict(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from config.json (and optionally generation_config.json) contents."""
    model_type = raw.get("model_type", "")
    if model_type not in FAMILY_QKV_BIAS:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {sorted(FAMILY_QKV_BIAS)})")
    _check_architecture(raw, model_type)
    if raw.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=true is not supported ({model_type})")
    forced_bias = FAMILY_QKV_BIAS[model_type]
    if forced_bias is False and raw.get("attention_bias"):
        raise ValueError(f"attention_bias=true is not supported for {model_type}")
    num_heads = int(raw["num_attention_heads"])
    head_dim = raw.get("head_dim") or DEFAULT_HEAD_DIM[model_type] or int(raw["hidden_size"]) // num_heads
    theta, scaling = _rope(raw)
    eos = _eos_ids((generation or {}).get("eos_token_id")) or _eos_ids(raw.get("eos_token_id"))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=_max_positions(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", False)) if forced_bias is None else forced_bias,
        rope_scaling=scaling,
        eos_token_ids=eos,
        qk_norm=model_type in QK_NORM_FAMILIES,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` (and `generation_config.json` when present) of an HF model directory."""
    folder = Path(model_dir)
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not an HF model directory")
    generation_path = folder / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
    return config_from_dict(json.loads(path.read_text()), generation)
