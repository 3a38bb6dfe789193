"""HF safetensors checkpoints: read a model directory's weights by HF name, and check names and shapes.

The HF names of a Llama/Qwen2/Qwen3 decoder are the contract between trainer, weight transport and every
rollout engine: `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight` (+ q/k/v
`.bias` for Qwen2; + `model.layers.{i}.self_attn.{q,k}_norm.weight` [head_dim] for Qwen3),
`model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.layers.{i}.input_layernorm.weight`,
`model.layers.{i}.post_attention_layernorm.weight`, `model.norm.weight` and, when the head is untied,
`lm_head.weight`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_hpc.models.config import ModelConfig, load_config

if TYPE_CHECKING:
    import torch

TIED_HEAD_NAME = "lm_head.weight"


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight the decoder reads."""
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes[TIED_HEAD_NAME] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    return shapes


def check_weights(config: ModelConfig, tensors: dict[str, torch.Tensor], complete: bool) -> None:
    """Raise ValueError on unknown names, wrong shapes, or (if `complete`) missing names.

    For a tied head, `lm_head.weight` is accepted and must already be left out by the caller (it is
    the embedding); see `drop_tied_head`.
    """
    shapes = expected_shapes(config)
    unknown = sorted(set(tensors) - set(shapes))
    if unknown:
        raise ValueError(f"unknown weight names for this {config.model_type} model: {unknown[:5]}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {shapes[name]}")
    missing = sorted(set(shapes) - set(tensors)) if complete else []
    if missing:
        raise ValueError(f"missing weights: {missing[:5]} ({len(missing)} in all)")


def drop_tied_head(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove `lm_head.weight` when the head is tied: HF state dicts list it, but it is the embedding."""
    if config.tie_word_embeddings:
        tensors.pop(TIED_HEAD_NAME, None)
    return tensors


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors (or index) in {folder}")
    return [single]


def load_weights(model_dir: str | Path, config: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """All decoder weights of an HF safetensors directory, by HF name, checked against the config."""
    from safetensors.torch import load_file

    folder = Path(model_dir)
    config = config or load_config(folder)
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(folder):
        tensors.update(load_file(str(path)))
    tensors = drop_tied_head(config, tensors)
    check_weights(config, tensors, complete=True)
    return tensors
