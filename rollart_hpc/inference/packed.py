"""Per-version weight snapshots for the forward pass, built from HF-named tensors.

q/k/v and gate/up projections are concatenated once at pack time so that a layer is 4 matmuls. A
`PackedWeights` is never written while a forward pass may read it: the engine keeps two (double
buffer), writes a new version into the one no forward reads (`unpack_weights` gives its contiguous
HF-named views; `relink_weights` then re-derives the backend's layouts) and swaps between two steps,
so a forward pass that holds one snapshot can never see two versions.

Linear backends (explicit registry): "dense" runs `F.linear` on the [out, in] weight (bit-for-bit the
arithmetic HF uses); "onednn" additionally keeps a oneDNN-prepacked copy of each weight and runs
`mkldnn._linear_pointwise` on it (about 1.5x faster at decode batch sizes on CPU; results differ from
dense in the last bits). The dense weight is always kept: it is what `unpack_weights` returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from rollart_hpc.models.config import ModelConfig

LINEAR_BACKENDS = ("dense", "onednn")


@dataclass(frozen=True)
class Linear:
    """y = x W^T + b with W [out, in]; `packed` is the backend's private layout of W, if any."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer: qkv [(H + 2 Hkv) D, hidden] (+ bias), o_proj, gate_up [2 I, hidden], down;
    `q_norm`, `k_norm` [D]: the per-head RMSNorm weights of queries and keys (Qwen3), else None."""

    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class PackedWeights:
    """One policy version's weights, ready for the forward pass."""

    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: Linear


def resolve_backend(backend: str, dtype: torch.dtype) -> str:
    """'auto' -> 'onednn' for float32 where oneDNN is built in, else 'dense'; validate explicit names."""
    if backend == "auto":
        return "onednn" if dtype == torch.float32 and torch.backends.mkldnn.is_available() else "dense"
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be auto or one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "onednn" and not torch.backends.mkldnn.is_available():
        raise ValueError("linear backend 'onednn' needs a torch build with oneDNN (mkldnn)")
    return backend


def _own(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A private contiguous copy, so that later in-place changes by the sender cannot leak in."""
    return tensor.detach().to(dtype=dtype, copy=True).contiguous()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> Linear:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16) if backend == "onednn" else None
    return Linear(weight=weight, bias=bias, packed=packed)


def _layer(
    config: ModelConfig, hf: dict[str, torch.Tensor], i: int, dtype: torch.dtype, backend: str
) -> LayerWeights:
    p = f"model.layers.{i}."

    def get(name: str) -> torch.Tensor:
        return _own(hf[p + name], dtype)

    bias = torch.cat([get(f"self_attn.{x}_proj.bias") for x in "qkv"]) if config.qkv_bias else None
    qkv = torch.cat([get(f"self_attn.{x}_proj.weight") for x in "qkv"])
    gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
    return LayerWeights(
        input_norm=get("input_layernorm.weight"),
        qkv=_linear(qkv, bias, backend),
        o_proj=_linear(get("self_attn.o_proj.weight"), None, backend),
        post_norm=get("post_attention_layernorm.weight"),
        gate_up=_linear(gate_up, None, backend),
        down=_linear(get("mlp.down_proj.weight"), None, backend),
        q_norm=get("self_attn.q_norm.weight") if config.qk_norm else None,
        k_norm=get("self_attn.k_norm.weight") if config.qk_norm else None,
    )


def pack_weights(
    config: ModelConfig, hf: dict[str, torch.Tensor], dtype: torch.dtype, backend: str = "dense"
) -> PackedWeights:
    """Pack a complete HF-named weight dict (as from `checkpoint.load_weights`) into a new snapshot."""
    backend = resolve_backend(backend, dtype)
    with torch.no_grad():  # plain tensors (not inference tensors): later versions are written into them
        embed = _own(hf["model.embed_tokens.weight"], dtype)
        head = embed if config.tie_word_embeddings else _own(hf["lm_head.weight"], dtype)
        return PackedWeights(
            embed=embed,
            layers=tuple(_layer(config, hf, i, dtype, backend) for i in range(config.num_layers)),
            norm=_own(hf["model.norm.weight"], dtype),
            lm_head=_linear(head, None, backend),
        )


def relink_weights(weights: PackedWeights, backend: str) -> PackedWeights:
    """`weights` after its dense tensors were written in place: the backend's private layouts derived
    again (a new snapshot sharing the dense tensors), or `weights` itself when the backend has none."""
    if backend != "onednn":
        return weights

    def relink(linear: Linear) -> Linear:
        return _linear(linear.weight, linear.bias, backend)

    layers = tuple(
        dataclasses.replace(
            layer,
            qkv=relink(layer.qkv),
            o_proj=relink(layer.o_proj),
            gate_up=relink(layer.gate_up),
            down=relink(layer.down),
        )  # fmt: skip
        for layer in weights.layers
    )
    return PackedWeights(weights.embed, layers, weights.norm, relink(weights.lm_head))


def unpack_weights(config: ModelConfig, packed: PackedWeights) -> dict[str, torch.Tensor]:
    """HF-named views into a snapshot's dense weights (no copies); the inverse of `pack_weights`."""
    hf = {"model.embed_tokens.weight": packed.embed, "model.norm.weight": packed.norm}
    if not config.tie_word_embeddings:
        hf["lm_head.weight"] = packed.lm_head.weight
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i, layer in enumerate(packed.layers):
        p = f"model.layers.{i}."
        for name, part in zip("qkv", layer.qkv.weight.split([q, kv, kv]), strict=True):
            hf[f"{p}self_attn.{name}_proj.weight"] = part
        if layer.qkv.bias is not None:
            for name, part in zip("qkv", layer.qkv.bias.split([q, kv, kv]), strict=True):
                hf[f"{p}self_attn.{name}_proj.bias"] = part
        hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = layer.gate_up.weight.chunk(2)
        hf[p + "mlp.down_proj.weight"] = layer.down.weight
        hf[p + "self_attn.o_proj.weight"] = layer.o_proj.weight
        hf[p + "input_layernorm.weight"] = layer.input_norm
        hf[p + "post_attention_layernorm.weight"] = layer.post_norm
        if layer.q_norm is not None and layer.k_norm is not None:
            hf[p + "self_attn.q_norm.weight"], hf[p + "self_attn.k_norm.weight"] = layer.q_norm, layer.k_norm
    return hf
