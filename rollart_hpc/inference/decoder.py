"""The Llama/Qwen2/Qwen3 forward pass in plain torch over a slot KV cache (no HF model involved).

RMSNorm, rotary embeddings (HF `rope_parameters`: default, linear, llama3), grouped-query attention
through `scaled_dot_product_attention`, SwiGLU MLP, tied or untied head, Qwen2 q/k/v bias, Qwen3 per-head
q/k RMSNorm (before RoPE).

Weights come as a `PackedWeights` snapshot (see packed.py); each forward pass reads exactly one.

The cache holds, per layer, keys and values of shape [num_slots, num_kv_heads, max_len, head_dim].
`forward(token_ids, segments)` runs one ragged batch: each `Segment` is `length` new tokens of the
sequence in cache row `slot` at positions start..start+length-1, attending to that row's cached
prefix [0, start) and causally to themselves. One-token segments (decode) are attended as a batch;
the engine keeps their rows contiguous (0..B-1) so the cache is read through views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from rollart_hpc.inference.packed import LayerWeights, PackedWeights
from rollart_hpc.models.config import ModelConfig


def _inv_freq(config: ModelConfig) -> torch.Tensor:
    """HF's rotary inverse frequencies, in float32, for the supported rope types."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv, scaling)
    return inv


def _llama3_inv_freq(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(config: ModelConfig, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_len, head_dim] (HF layout: frequencies repeated twice)."""
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(positions, _inv_freq(config))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SlotKVCache:
    """Preallocated keys/values for `num_slots` sequences of up to `max_len` tokens each."""

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype) -> None:
        shape = (num_slots, config.num_kv_heads, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of slot `src` into slot `dst`."""
        for cache in (*self.keys, *self.values):
            cache[dst, :, :length] = cache[src, :, :length]


@dataclass(frozen=True)
class Segment:
    """`length` new tokens of the sequence in cache row `slot`, at positions start..start+length-1."""

    slot: int
    start: int
    length: int


class Decoder:
    """Stateless forward pass of one architecture; weights are passed per call, state lives in the cache.

    `forward` runs one ragged batch: all new tokens of all segments go through the projections and
    MLPs as one [N, hidden] matrix; attention is batched over the leading one-token segments
    (decode) and run per segment for the others (prefill, attending to the cached prefix).
    """

    def __init__(self, config: ModelConfig, max_len: int, dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.dtype = dtype
        self.cos, self.sin = rope_tables(config, max_len, dtype)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    def _qkv(self, layer: LayerWeights, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Project the normed hidden states [N, hidden] to rotated q [N, H, D], k, v [N, Hkv, D]."""
        c = self.config
        qkv = layer.qkv(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(-1, c.num_heads, c.head_dim), k.view(-1, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = F.rms_norm(q, (c.head_dim,), layer.q_norm, c.rms_norm_eps)
            k = F.rms_norm(k, (c.head_dim,), layer.k_norm, c.rms_norm_eps)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v.view(-1, c.num_kv_heads, c.head_dim)

    def _mlp_block(self, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + layer.o_proj(attn)
        h = F.rms_norm(x, (x.shape[-1],), layer.post_norm, self.config.rms_norm_eps)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up)

    def _head(self, weights: PackedWeights, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, (x.shape[-1],), weights.norm, self.config.rms_norm_eps)
        return weights.lm_head(h).float()

    def _decode_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """q [B, H, D] against each row's cache [B, Hkv, span, D] up to its position; returns [B, H*D].

        The G query heads sharing a KV head are laid out as G query rows of that head, so no KV repeat.
        """
        c = self.config
        b, span = q.shape[0], keys.shape[2]
        mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None, :]
        q = q.reshape(b, c.num_kv_heads, c.num_groups, c.head_dim)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).reshape(b, self.q_size)

    def _segment_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
    ) -> torch.Tensor:
        """q [T, H, D] of one segment against its cache [1, Hkv, start+T, D], causally; returns [T, H*D]."""
        t, end = q.shape[0], keys.shape[2]
        mask = None if start == 0 else torch.arange(start, end)[:, None] >= torch.arange(end)[None, :]
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )
        return attn.squeeze(0).transpose(0, 1).reshape(t, self.q_size)

    def _attention(self, i: int, cache: SlotKVCache, q: torch.Tensor, batch: _Ragged) -> torch.Tensor:
        """Attention output [N, H*D] for layer i; the cache already holds this pass's keys and values."""
        keys, values = cache.keys[i], cache.values[i]
        parts = []
        nd = batch.num_decode
        if nd:
            span = batch.decode_span
            if batch.decode_contiguous:
                k, v = keys[:nd, :, :span], values[:nd, :, :span]
            else:
                k, v = keys[batch.decode_slots, :, :span], values[batch.decode_slots, :, :span]
            parts.append(self._decode_attention(q[:nd], k, v, batch.positions[:nd]))
        for seg, offset in zip(batch.extend, batch.extend_offsets, strict=True):
            end = seg.start + seg.length
            k, v = keys[seg.slot : seg.slot + 1, :, :end], values[seg.slot : seg.slot + 1, :, :end]
            parts.append(self._segment_attention(q[offset : offset + seg.length], k, v, seg.start))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(
        self,
        weights: PackedWeights,
        cache: SlotKVCache,
        token_ids: torch.Tensor,
        segments: list[Segment],
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Logits (float32) of the last token of each segment [S, V], or of every token [N, V].

        `token_ids` [N] holds the segments' tokens in order. The leading run of one-token segments
        is attended as one batch (fastest when their slots are 0..B-1); the rest one by one.
        """
        c = self.config
        batch = _Ragged.build(segments)
        x = F.embedding(token_ids, weights.embed)
        for i, layer in enumerate(weights.layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.input_norm, c.rms_norm_eps)
            q, k, v = self._qkv(layer, h, batch.positions)
            cache.keys[i][batch.slots, :, batch.positions] = k
            cache.values[i][batch.slots, :, batch.positions] = v
            x = self._mlp_block(layer, x, self._attention(i, cache, q, batch))
        return self._head(weights, x if all_logits else x[batch.last_index])

    def extend(
        self,
        weights: PackedWeights,
        cache: SlotKVCache,
        slot: int,
        token_ids: torch.Tensor,
        start: int,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """One segment: logits of its last token [V], or of every token [T, V] if `all_logits`."""
        logits = self.forward(
            weights, cache, token_ids, [Segment(slot, start, token_ids.shape[0])], all_logits
        )
        return logits if all_logits else logits[0]


@dataclass(frozen=True)
class _Ragged:
    """Index tensors of one ragged batch, built once per forward pass."""

    positions: torch.Tensor
    slots: torch.Tensor
    last_index: torch.Tensor
    num_decode: int
    decode_slots: torch.Tensor
    decode_contiguous: bool
    decode_span: int
    extend: list[Segment]
    extend_offsets: list[int]

    @staticmethod
    def build(segments: list[Segment]) -> _Ragged:
        num_decode = next((i for i, s in enumerate(segments) if s.length != 1), len(segments))
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments])
        slots = torch.cat([torch.full((s.length,), s.slot) for s in segments])
        lengths = torch.tensor([s.length for s in segments])
        decode_slots = slots[:num_decode]
        offsets = (lengths.cumsum(0) - lengths).tolist()
        return _Ragged(
            positions=positions,
            slots=slots,
            last_index=lengths.cumsum(0) - 1,
            num_decode=num_decode,
            decode_slots=decode_slots,
            decode_contiguous=decode_slots.tolist() == list(range(num_decode)),
            decode_span=int(positions[:num_decode].max()) + 1 if num_decode else 0,
            extend=segments[num_decode:],
            extend_offsets=offsets[num_decode:],
        )
