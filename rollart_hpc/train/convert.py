"""HF <-> Megatron-core (local layer spec) weights and architecture arguments for Llama, Qwen2 and Qwen3.

HF names are those of `rollart_hpc.models.checkpoint` (a tied head has no `lm_head.weight`). Megatron
names are those of `GPTModel.state_dict()` with the local spec; `megatron_to_hf` also accepts the
Transformer-Engine names of the fused norms (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).

Invariants: HF -> Megatron -> HF is bit-exact (only views, slices and concatenations); the q/k/v rows are
interleaved per query group `[q heads of g; k_g; v_g]`; fc1 is `cat([gate, up])` per tensor-parallel rank;
RoPE needs no row permutation (Megatron's rotate-half equals HF's). Qwen3's per-head q/k RMSNorm weights
(`self_attn.{q,k}_norm.weight`) are `self_attention.{q,k}_layernorm.weight` (spec and TransformerConfig
with `qk_layernorm=True`), replicated on every tensor-parallel rank. Llama 3 RoPE scaling maps to
GPTModel's `rope_scaling`, which computes HF's llama3 inverse frequencies with low/high frequency factors
1 and 4 and an original context of 8192 fixed; other values are refused. Tensor parallelism: column-parallel
weights (qkv, fc1, embedding, output layer) are split on dim 0, row-parallel ones (proj, fc2) on dim 1.
The embedding and output layer carry zero rows up to `padded_vocab_size` (dropped again on the way out).
Pipeline parallelism: `to_stage` / `from_stage` keep a stage's layers and renumber them.

Two ways in: `hf_to_megatron` converts whole HF tensors held in memory; `read_stage` reads from a
`SliceReader` (`models.checkpoint.CheckpointReader`) only the tensors of one pipeline stage and, for the
tensor-parallel splits, only this rank's rows or columns (the fused qkv: the key/value groups its rows
overlap), and gives exactly `to_stage(hf_to_megatron(...))`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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
VOCAB_MULTIPLE = 128
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
        if float(scaling[key]) != expected:
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
        "qk_layernorm": cfg.qk_norm,
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
        "vocab_size": padded_vocab_size(cfg.vocab_size),
        "max_sequence_length": cfg.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": int(cfg.rope_theta),
        "share_embeddings_and_output_weights": cfg.tie_word_embeddings,
        **_rope_args(cfg),
    }
    return MegatronArgs(transformer, gpt)


def qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q/k/v (weights [.., H] or biases) -> Megatron's per-group interleaved linear_qkv."""
    return _fuse_groups(q, k, v, cfg.num_kv_heads, cfg.num_groups * cfg.head_dim, cfg.head_dim)


def _fuse_groups(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ng: int, q_rows: int, hn: int
) -> torch.Tensor:
    """`ng` consecutive key/value groups' q ([ng * q_rows, ..]), k and v ([ng * hn, ..]) interleaved."""
    rest = q.shape[1:]
    parts = [q.view(ng, q_rows, *rest), k.view(ng, hn, *rest), v.view(ng, hn, *rest)]
    return torch.cat(parts, 1).reshape(-1, *rest)


def qkv_split(w: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `qkv_fuse` for the whole (unsharded) tensor."""
    ng, hn, rest = cfg.num_kv_heads, cfg.head_dim, w.shape[1:]
    q, k, v = torch.split(w.view(ng, (cfg.num_groups + 2) * hn, *rest), [cfg.num_groups * hn, hn, hn], 1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def padded_vocab_size(vocab_size: int) -> int:
    """Megatron's vocabulary: the HF one rounded up to a multiple of `VOCAB_MULTIPLE`, the same for every
    tensor-parallel size (so checkpoints move between layouts). The padding rows of the embedding and
    the head are zero and their logits are masked out of every softmax."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def check_tensor_parallel(cfg: ModelConfig, tp_size: int) -> None:
    """ValueError unless `tp_size` divides the heads and the padded vocabulary, and the key/value groups
    divide or are divided by it (fewer groups than ranks: Megatron gathers the fused qkv, picks its group)."""
    groups_ok = tp_size >= 1 and (cfg.num_kv_heads % tp_size == 0 or tp_size % cfg.num_kv_heads == 0)
    if not groups_ok or cfg.num_heads % tp_size or padded_vocab_size(cfg.vocab_size) % tp_size:
        raise ValueError(
            f"tensor parallel size {tp_size} must divide num_heads {cfg.num_heads} and the padded vocabulary "
            f"{padded_vocab_size(cfg.vocab_size)}, and divide or be a multiple of num_kv_heads {cfg.num_kv_heads}"
        )


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


_check_tp = check_tensor_parallel


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The global decoder-layer indices of pipeline stage `pp_rank` (equal, contiguous slices)."""
    if pp_size < 1 or num_layers % pp_size:
        raise ValueError(f"pipeline parallel size {pp_size} must divide num_layers {num_layers}")
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def _renumber(key: str, shift: int) -> str:
    prefix = "decoder.layers."
    if not key.startswith(prefix):
        return key
    index, rest = key[len(prefix) :].split(".", 1)
    return f"{prefix}{int(index) + shift}.{rest}"


def to_stage(
    full: dict[str, torch.Tensor], layers: range, first: bool, last: bool, tied: bool
) -> dict[str, torch.Tensor]:
    """A whole-model (one TP shard) state dict -> the state dict of the pipeline stage holding `layers`
    (local layer numbers). A last stage that is not the first holds its own copy of a tied embedding
    as `output_layer.weight` (Megatron keeps the two in step by all-reducing their gradients)."""
    out = {}
    for key, value in full.items():
        if key.startswith("decoder.layers."):
            index = int(key.split(".")[2])
            if index in layers:
                out[_renumber(key, -layers.start)] = value
        elif (key == EMBED and first) or (key in (FINAL_NORM, OUTPUT) and last):
            out[key] = value
    if tied and last and not first:
        out[OUTPUT] = full[EMBED]
    return out


def from_stage(
    stage: dict[str, torch.Tensor], layers: range, first: bool, tied: bool
) -> dict[str, torch.Tensor]:
    """Inverse of `to_stage`: global layer numbers; a tied embedding's copy on the last stage dropped."""
    out = {_renumber(k, layers.start): v for k, v in stage.items()}
    if tied and not first:
        out.pop(OUTPUT, None)
    return out


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
    if cfg.qk_norm:
        out[m + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
    kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    for kind in kinds:
        q, k, v = (hf[f"{attn}{p}_proj.{kind}"] for p in "qkv")
        out[f"{m}self_attention.linear_qkv.{kind}"] = qkv_fuse(q, k, v, cfg).chunk(tp, 0)[rank]
    return out


class SliceReader(Protocol):
    """`read(name)`: a whole HF tensor; `read(name, dim, start, stop)`: its indices [start, stop) along
    `dim` (0 or 1), read without the rest of the tensor."""

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor: ...


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """The indices of `torch.chunk(size, parts)[index]` along the split dimension."""
    step = -(-size // parts)
    return min(index * step, size), min((index + 1) * step, size)


def _read_chunk(reader: SliceReader, name: str, size: int, dim: int, rank: int, tp: int) -> torch.Tensor:
    lo, hi = chunk_range(size, tp, rank)
    return reader.read(name, dim, lo, hi) if tp > 1 else reader.read(name)


def _read_vocab_rows(reader: SliceReader, name: str, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """This rank's rows of the padded embedding (or head): the real rows read, the padding zero."""
    lo, hi = chunk_range(padded_vocab_size(cfg.vocab_size), tp, rank)
    rows = reader.read(name, 0, min(lo, cfg.vocab_size), min(hi, cfg.vocab_size))
    return _pad_rows(rows, hi - lo)


def _read_qkv(
    reader: SliceReader, cfg: ModelConfig, attn: str, kind: str, rank: int, tp: int
) -> torch.Tensor:
    """This rank's rows of the fused qkv `kind`: the q/k/v rows of the groups they overlap, fused, sliced."""
    hn, q_rows = cfg.head_dim, cfg.num_groups * cfg.head_dim
    block = q_rows + 2 * hn
    lo, hi = chunk_range(cfg.num_kv_heads * block, tp, rank)
    g0, g1 = lo // block, -(-hi // block)
    q = reader.read(f"{attn}q_proj.{kind}", 0, g0 * q_rows, g1 * q_rows)
    k, v = (reader.read(f"{attn}{p}_proj.{kind}", 0, g0 * hn, g1 * hn) for p in "kv")
    return _fuse_groups(q, k, v, g1 - g0, q_rows, hn)[lo - g0 * block : hi - g0 * block]


def _read_layer(reader: SliceReader, cfg: ModelConfig, i: int, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """`_layer_to_megatron` of layer `i` for one rank, reading only that rank's slices."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn, q_out, ffn = h + "self_attn.", cfg.num_heads * cfg.head_dim, cfg.intermediate_size
    out = {
        m + "input_layernorm.weight": reader.read(h + "input_layernorm.weight"),
        m + "pre_mlp_layernorm.weight": reader.read(h + "post_attention_layernorm.weight"),
        m + "self_attention.linear_proj.weight": _read_chunk(
            reader, attn + "o_proj.weight", q_out, 1, rank, tp
        ),
        m + "mlp.linear_fc2.weight": _read_chunk(reader, h + "mlp.down_proj.weight", ffn, 1, rank, tp),
    }
    gate = _read_chunk(reader, h + "mlp.gate_proj.weight", ffn, 0, rank, tp)
    up = _read_chunk(reader, h + "mlp.up_proj.weight", ffn, 0, rank, tp)
    out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
    if cfg.qk_norm:
        out[m + "self_attention.q_layernorm.weight"] = reader.read(attn + "q_norm.weight")
        out[m + "self_attention.k_layernorm.weight"] = reader.read(attn + "k_norm.weight")
    for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
        out[f"{m}self_attention.linear_qkv.{kind}"] = _read_qkv(reader, cfg, attn, kind, rank, tp)
    return out


def read_stage(
    reader: SliceReader, cfg: ModelConfig, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
) -> dict[str, torch.Tensor]:
    """The local-spec state dict of one (TP rank, PP stage), equal to
    `to_stage(hf_to_megatron(hf, cfg, tp_rank, tp_size), ...)`, reading through `reader` only the stage's
    tensors (its layers; the embedding on the first stage; the final norm and head, or a tied
    embedding's copy, on the last) and only this rank's slices of the tensor-parallel ones."""
    _check_tp(cfg, tp_size)
    layers = stage_layers(cfg.num_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, torch.Tensor] = {}
    if first:
        out[EMBED] = _read_vocab_rows(reader, HF_EMBED, cfg, tp_rank, tp_size)
    if last:
        out[FINAL_NORM] = reader.read(HF_NORM)
        if not cfg.tie_word_embeddings:
            out[OUTPUT] = _read_vocab_rows(reader, HF_HEAD, cfg, tp_rank, tp_size)
        elif not first:
            out[OUTPUT] = _read_vocab_rows(reader, HF_EMBED, cfg, tp_rank, tp_size)
    for i in layers:
        for key, value in _read_layer(reader, cfg, i, tp_rank, tp_size).items():
            out[_renumber(key, -layers.start)] = value
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(
    hf: dict[str, torch.Tensor], cfg: ModelConfig, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """HF weights (tied head already dropped) -> the local-spec state dict of tensor-parallel rank `tp_rank`."""
    _check_tp(cfg, tp_size)
    rows = padded_vocab_size(cfg.vocab_size)
    out = {
        EMBED: _pad_rows(hf[HF_EMBED], rows).chunk(tp_size, 0)[tp_rank],
        FINAL_NORM: hf[HF_NORM],
    }
    if not cfg.tie_word_embeddings:
        out[OUTPUT] = _pad_rows(hf[HF_HEAD], rows).chunk(tp_size, 0)[tp_rank]
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
    if cfg.qk_norm:
        out[attn + "q_norm.weight"] = shards[0][m + "self_attention.q_layernorm.weight"]
        out[attn + "k_norm.weight"] = shards[0][m + "self_attention.k_layernorm.weight"]
    kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
    for kind in kinds:
        fused = torch.cat([s[f"{m}self_attention.linear_qkv.{kind}"] for s in shards], 0)
        for name, tensor in zip("qkv", qkv_split(fused, cfg), strict=True):
            out[f"{attn}{name}_proj.{kind}"] = tensor
    return out


def hf_units(num_layers: int, pp_size: int) -> list[tuple[str, int]]:
    """The units the HF weights are gathered in for publication, in the order `megatron_to_hf` emits them
    stage by stage: ("embed", 0) on the first stage, ("final", 0) (final norm and untied head) on the
    last, then ("layer", i) for each global layer i of the stage."""
    units: list[tuple[str, int]] = []
    for stage in range(pp_size):
        units += [("embed", 0)] if stage == 0 else []
        units += [("final", 0)] if stage == pp_size - 1 else []
        units += [("layer", i) for i in stage_layers(num_layers, stage, pp_size)]
    return units


def unit_entries(state: dict[str, torch.Tensor], unit: tuple[str, int]) -> dict[str, torch.Tensor]:
    """The entries of a Megatron shard (global layer numbers) that belong to `unit` (see `hf_units`)."""
    kind, index = unit
    if kind == "embed":
        return {k: v for k, v in state.items() if k == EMBED}
    if kind == "final":
        return {k: v for k, v in state.items() if k in (FINAL_NORM, OUTPUT)}
    prefix = f"decoder.layers.{index}."
    return {k: v for k, v in state.items() if k.startswith(prefix)}


def unit_to_hf(
    shards: list[dict[str, torch.Tensor]], cfg: ModelConfig, unit: tuple[str, int]
) -> dict[str, torch.Tensor]:
    """HF weights of one unit from the entries of every tensor-parallel rank holding it, in rank order."""
    kind, index = unit
    return megatron_to_hf(shards, cfg, range(index, index + 1) if kind == "layer" else range(0))


def megatron_to_hf(
    shards: list[dict[str, torch.Tensor]], cfg: ModelConfig, layers: range | None = None
) -> dict[str, torch.Tensor]:
    """Megatron state dicts of all tensor-parallel ranks, in rank order -> HF weights (no tied lm_head).

    `layers`: the global layer numbers the shards hold (None: the whole model, every tensor required);
    with a range, the embedding, final norm and output layer are converted where present (a stage)."""
    _check_tp(cfg, len(shards))
    whole = layers is None
    first = shards[0]
    out = {}
    vocab = cfg.vocab_size
    if whole or EMBED in first:
        out[HF_EMBED] = torch.cat([s[EMBED] for s in shards], 0)[:vocab]
    if whole or FINAL_NORM in first:
        out[HF_NORM] = first[FINAL_NORM]
    if not cfg.tie_word_embeddings and (whole or OUTPUT in first):
        out[HF_HEAD] = torch.cat([s[OUTPUT] for s in shards], 0)[:vocab]
    for i in range(cfg.num_layers) if layers is None else layers:
        out.update(_layer_to_hf(shards, cfg, i))
    return {k: v.contiguous() for k, v in out.items()}
