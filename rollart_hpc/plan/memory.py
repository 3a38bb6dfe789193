"""Bytes a trainer or rollout rank holds on its GPU, term by term, from the model's shapes. Torch-free.

Assumptions (each term's docstring says which it uses):
- Trainer state (Megatron DDP with `grad_reduce_in_fp32`, Adam): fp32 = 4 B parameters + 4 B gradients +
  8 B Adam moments; bf16 = 2 B parameters + 4 B fp32 main gradients + 4 B fp32 main parameters + 8 B Adam
  moments. With the distributed optimizer the main parameters and Adam moments are sharded over the
  data-parallel ranks (fp32 parameters are their own main copy, so fp32 has no main-parameter term).
- Sharding: TP splits the attention and MLP matrices (and the q/k/v biases) and the padded vocabulary of
  the embedding and LM head; norms are replicated. PP gives each stage num_layers / PP layers, the
  embedding to the first stage, the final norm and LM head to the last; tied embeddings are held by both
  the first and the last stage (one copy at PP = 1).
- Activations of one micro-batch per layer follow Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", Table 2) term by term, generalised to what this trainer's
  layers keep (Megatron's local spec, no fusions): grouped-query attention, RoPE (the q/k/v projection's
  output, the rotated halves, the rotated q and k), a gated (SwiGLU) MLP of any width (its gate and up
  output, the activation's output and the product) and no dropout. With the paper's layer (no RoPE, MLP
  4h, GeLU, dropout masks, 2-byte activations) it is exactly s b h (34 + 5 a s / h). Sequence parallelism
  divides the terms outside the TP matmuls by TP; the terms inside are always divided. 'selective' drops
  the core-attention terms, 'full' keeps the layer input only (plus one layer's activations while it is
  recomputed). 'sdpa' keeps no [s, s] scores (only the fp32 log-sum-exp per head and token); 'unfused'
  keeps the softmax output in fp32 (and its cast to the compute dtype when that is narrower), and the key
  and value repeated to every query head. A micro-batch holds micro_batch_tokens tokens in rows of at most
  rollout.max_model_len (a longer sequence is a micro-batch alone), the [s, s] terms taken at that row.
- Backward: the gradient of a layer's largest tensor and the gradient of its input are live together
  (`backward_transient_bytes`).
- 1F1B: pipeline stage i (of PP) holds the activations of PP - i micro-batches; PP = 1 holds one.
- The loss: 'fused' holds one chunk of fp32 logits (LOGITS_CHUNK_ELEMENTS) and its gradient; 'eager' the
  [tokens, vocab / TP] fp32 logits and their gradient.
- Weight publication (`weights/publisher.py`, as the trainer and rollout ranks use it): each side keeps
  at most PUBLISH_DEPTH bucket broadcasts in flight. The first trainer holds its ring of PUBLISH_DEPTH
  send buckets of trainer.bucket_mb (a tensor larger than a bucket goes out straight from the unit it
  belongs to) and the unit at hand: at TP = PP = 1 one converted unit (the largest: a layer or the
  embedding), under TP or PP one gathered layer (`weight_gather`, on every rank of the first replica).
  Every receiver holds its ring of PUBLISH_DEPTH receive buffers, each as large as a bucket or the
  largest tensor, and a vLLM engine a staging buffer on its GPU besides, of one chunk: at most
  trainer.bucket_mb or the largest tensor (the built-in engine: a staged copy of its weights). The
  published dtype is the training precision's. Loading reads only the rank's shard of the checkpoint
  (host memory, not counted here: no rank reads the whole model).
- Every GPU process has CUDA_CONTEXT_BYTES of context, library workspaces and NCCL buffers.
- A vLLM engine takes gpu_memory_utilization x the GPU's memory for its weights, activations, CUDA graphs
  and KV cache; the KV-cache room reported is that share less the weights (vLLM's activation peak, which it
  measures at start, comes out of this room too).

What only a GPU can validate: the flash / memory-efficient SDPA kernels (the CPU trainer runs the local
DotProductAttention or the CPU SDPA kernel), bf16 storage (the CPU trainer keeps fp32), the CUDA context,
NCCL buffers, the caching allocator's fragmentation and vLLM's own share.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rollart_hpc.models.config import ModelConfig

VOCAB_MULTIPLE = 128  # Megatron's padded vocabulary (train/convert.py: padded_vocab_size)
LOGITS_CHUNK_ELEMENTS = 1 << 22  # train/lm_head.py: LOGITS_BUDGET_ELEMENTS, fp32 logits held per chunk
CUDA_CONTEXT_BYTES = 1 << 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "float32": 4, "bfloat16": 2}
PUBLISH_DEPTH = 2  # weights/publisher.py: bucket broadcasts in flight on the sending and receiving side


@dataclass(frozen=True)
class StageLayout:
    """A trainer rank's place: TP, PP and DP sizes and its pipeline stage."""

    tp: int
    pp: int
    dp: int
    stage: int = 0


@dataclass(frozen=True)
class LayerShape:
    """What one transformer layer's activations depend on (Korthikanti et al.'s h, a, and the MLP)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    gated: bool = True
    dropout: bool = False
    rope: bool = True

    @classmethod
    def of(cls, cfg: ModelConfig) -> LayerShape:
        """A Llama / Qwen2 layer: SwiGLU MLP, RoPE, no dropout (the trainer runs with dropout 0)."""
        return cls(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)


@dataclass(frozen=True)
class Activations:
    """How a micro-batch is run: its tokens, its longest row, and the trainer's activation settings."""

    tokens: int
    row_len: int
    dtype_bytes: int
    sequence_parallel: bool = False
    recompute: str = "none"
    attention: str = "sdpa"


def padded_vocab(vocab_size: int) -> int:
    """Megatron's vocabulary rows: the HF vocabulary rounded up to a multiple of VOCAB_MULTIPLE."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def layer_params(cfg: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank (matrices and q/k/v biases split, norms not)."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    split = h * qkv + (qkv if cfg.qkv_bias else 0) + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    return split // tp + 2 * h


def stage_params(cfg: ModelConfig, lay: StageLayout) -> int:
    """Parameters of one TP rank of pipeline stage `lay.stage`."""
    first, last = lay.stage == 0, lay.stage == lay.pp - 1
    embedding = padded_vocab(cfg.vocab_size) * cfg.hidden_size // lay.tp
    count = cfg.num_layers // lay.pp * layer_params(cfg, lay.tp)
    count += embedding if first else 0
    if last:
        count += cfg.hidden_size  # final norm
        count += embedding if not (cfg.tie_word_embeddings and first) else 0
    return count


def model_params(cfg: ModelConfig) -> int:
    """Parameters of the whole HF model (unpadded vocabulary, a tied head counted once)."""
    embedding = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embedding
    return cfg.num_layers * layer_params(cfg, 1) + embedding + head + cfg.hidden_size


def largest_tensor_params(cfg: ModelConfig) -> int:
    """Elements of the model's largest HF tensor: the embedding (or head) or an MLP matrix."""
    return max(cfg.vocab_size, cfg.intermediate_size) * cfg.hidden_size


def largest_unit_params(cfg: ModelConfig) -> int:
    """Parameters of the largest publication unit (`train/convert.py: hf_units`): a layer, the
    embedding, or the final norm and untied head."""
    return max(layer_params(cfg, 1), cfg.vocab_size * cfg.hidden_size + cfg.hidden_size)


def publication_bytes(cfg: ModelConfig, dtype_bytes: int, bucket_bytes: int, model_parallel: int) -> int:
    """The first trainer's publication buffers: PUBLISH_DEPTH send buckets and, at TP = PP = 1, the
    converted unit at hand (under TP or PP the gathered unit is the `weight_gather` term)."""
    unit = largest_unit_params(cfg) * dtype_bytes if model_parallel == 1 else 0
    return PUBLISH_DEPTH * bucket_bytes + unit


def receive_bytes(cfg: ModelConfig, dtype_bytes: int, bucket_bytes: int) -> int:
    """A receiver's ring: PUBLISH_DEPTH buffers as large as a bucket or the largest tensor."""
    return PUBLISH_DEPTH * max(bucket_bytes, largest_tensor_params(cfg) * dtype_bytes)


def state_terms(params: int, precision: str, dp: int, distributed: bool) -> dict[str, int]:
    """Parameters, gradients and optimizer states of `params` parameters on one rank."""
    shard = dp if distributed else 1
    terms = {
        "params": params * DTYPE_BYTES[precision],
        "grads": params * 4,
        "adam": -(-params * 8 // shard),
    }
    if precision == "bf16":
        terms["main_params"] = -(-params * 4 // shard)
    return terms


def layer_activation_bytes(shape: LayerShape, act: Activations, tp: int) -> int:
    """Bytes one layer keeps for backward of one micro-batch (Korthikanti et al., see the module)."""
    t, e, h = act.tokens, act.dtype_bytes, shape.hidden
    sp = tp if act.sequence_parallel else 1
    if act.recompute == "full":
        return e * t * h // sp
    mask = 1 if shape.dropout else 0
    # Outside the TP matmuls: norm inputs, the q/k/v and MLP inputs (norm outputs), the dropout masks.
    outside = (4 * e + 2 * mask) * t * h
    # Inside: q, k, v (and what RoPE keeps), the attention output (projection input), the MLP's hidden.
    mlp = (4 if shape.gated else 2) * shape.ffn
    inside = e * t * (attention_input_width(shape, act.attention) + shape.heads * shape.head_dim + mlp)
    core = 0 if act.recompute == "selective" else core_attention_bytes(shape, act)
    return outside // sp + (inside + core) // tp


def attention_input_width(shape: LayerShape, attention: str) -> int:
    """Elements per token the attention's input side keeps: the q/k/v projection's output (q, k and v
    are views of it); with RoPE the rotated halves and the rotated q and k; with 'unfused' grouped-query
    attention the key and value repeated to every query head (Megatron's DotProductAttention)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    repeat = attention == "unfused" and kv < q
    width = q + 2 * kv
    if shape.rope:
        width += (q + kv) + q + (0 if repeat else kv)
    return width + (2 * q if repeat else 0)


def core_attention_bytes(shape: LayerShape, act: Activations) -> int:
    """What the core attention itself keeps: [s, s] scores per head ('unfused') or the log-sum-exp."""
    if act.attention == "sdpa":
        return 4 * shape.heads * act.tokens
    return score_bytes(shape, act) // 4 * (2 * act.dtype_bytes + 1 if shape.dropout else per_score(act))


def per_score(act: Activations) -> int:
    """Bytes per score element kept without dropout: the fp32 softmax output, and its cast to a narrower
    compute dtype."""
    return 4 + (act.dtype_bytes if act.dtype_bytes < 4 else 0)


def score_bytes(shape: LayerShape, act: Activations) -> int:
    """One fp32 [b, heads, s, s] tensor of a micro-batch (rows of act.row_len tokens)."""
    return 4 * shape.heads * act.row_len * act.tokens


def backward_transient_bytes(shape: LayerShape, act: Activations, tp: int) -> int:
    """Gradients live only in backward: the gradient of a layer's largest tensor and of its input
    together (the fp32 scores with 'unfused', else the MLP's gate and up output), plus the scores that
    selective recompute rebuilds."""
    mlp = act.dtype_bytes * act.tokens * (2 if shape.gated else 1) * shape.ffn
    if act.attention != "unfused":
        return 2 * mlp // tp
    scores = score_bytes(shape, act)
    rebuilt = scores if act.recompute == "selective" else 0
    return (2 * max(scores, mlp) + rebuilt) // tp


def activation_terms(
    cfg: ModelConfig, act: Activations, lay: StageLayout, shape: LayerShape, loss_impl: str
) -> dict[str, int]:
    """Activations of the micro-batches stage `lay.stage` holds under 1F1B, and on the last stage the
    final norm's and LM head's inputs and the loss's logits."""
    layers = cfg.num_layers // lay.pp
    terms = {"activations": layer_activation_bytes(shape, act, lay.tp) * layers * (lay.pp - lay.stage)}
    terms["backward_transient"] = backward_transient_bytes(shape, act, lay.tp)
    if act.recompute == "full":
        terms["recompute_layer"] = layer_activation_bytes(shape, replace(act, recompute="none"), lay.tp)
    if lay.stage == lay.pp - 1:
        sp = lay.tp if act.sequence_parallel else 1
        norm_input = act.dtype_bytes * act.tokens * cfg.hidden_size
        terms["head_input"] = norm_input // sp + norm_input
        terms["logits"] = logits_bytes(cfg, act.tokens, lay.tp, loss_impl)
    return terms


def logits_bytes(cfg: ModelConfig, tokens: int, tp: int, loss_impl: str) -> int:
    """fp32 logits and their gradient: one chunk ('fused') or [tokens, vocab / TP] ('eager')."""
    if loss_impl == "fused":
        return 2 * 4 * min(LOGITS_CHUNK_ELEMENTS, tokens * padded_vocab(cfg.vocab_size) // tp)
    return 2 * 4 * tokens * padded_vocab(cfg.vocab_size) // tp


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, tp: int = 1) -> int:
    """KV-cache bytes of one token position on one GPU: layers x (k, v) x kv heads / TP x head_dim."""
    kv_heads = max(1, cfg.num_kv_heads // tp)
    return cfg.num_layers * 2 * kv_heads * cfg.head_dim * dtype_bytes
