"""Core attention of the trainer's layers: Megatron's local layer spec with a choice of core attention.

`SdpaAttention` takes the place of Megatron's local `DotProductAttention` in the spec's self-attention:
same constructor, same forward signature, same layout (query [sq, b, np, hn], key and value
[sk, b, ng, hn] with ng <= np query groups of this tensor-parallel partition; output
[sq, b, np * hn]). It computes softmax(q k^T * scale + mask) v with one fused call, so the [s, s] scores
and probabilities are never kept for backward on CUDA:

- flash-attn's `flash_attn_varlen_func` when flash_attn is importable and the tensors are CUDA bf16/fp16,
  with no explicit mask (causal or no mask): packed `thd` inputs (`PackedSeqParams`) attend within their
  sequences' cumulative lengths, `sbhd` inputs within each of their b rows. GQA is native there.
- otherwise `torch.nn.functional.scaled_dot_product_attention` on [b, np, s, hn] views, the key/value
  groups taken as they are (`enable_gqa`, `native_gqa`) or repeated per query head (exactly Megatron's
  grouping) where the kernel needs it; on CUDA it is restricted to the flash, memory-efficient and cuDNN
  kernels, so an input no fused kernel takes fails instead of falling back to the math kernel that
  materialises the scores.

Masks follow Megatron's local attention: an explicit boolean `attention_mask` (True = masked, broadcast
to [b, np, sq, sk]) is used as given; without one, `AttnMaskType.causal` masks future keys (sq == sk)
and `no_mask` / `padding` attend everywhere. The trainer feeds right-padded rows with no mask: under the
causal mask a valid position only attends to earlier positions of its own row, all valid, so the result
is exact for every valid token, and padded positions never reach the loss.

There is no attention dropout (the project trains with none; a non-zero rate is refused), no attention
bias, no sliding window, no context parallelism and only the vanilla softmax; each is refused at
construction. Query-key layer scaling multiplies and divides the scale by the layer number in Megatron,
so the product used here is the same.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from rollart_hpc.train.config import ATTENTION_IMPLS

try:  # CUDA-only package, not installed on CPU machines; this path cannot run without a GPU.
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None

_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_FLASH_MAX_HEAD_DIM = 256


class SdpaAttention(MegatronModule):  # type: ignore[misc]
    """Megatron core attention on fused kernels; see the module docstring."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.utils import is_layer_window_attention
        from megatron.core.utils import divide

        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        if (
            config.context_parallel_size != 1
            or dropout != 0.0
            or windowed
            or config.softmax_type != "vanilla"
        ):
            raise ValueError(
                "SdpaAttention supports context_parallel_size 1, attention dropout 0, no sliding window and "
                f"the vanilla softmax; got {config.context_parallel_size}, {dropout}, "
                f"window {config.window_size}, {config.softmax_type!r}"
            )
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        world_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        head_dim = self.hidden_size_per_attention_head
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """[sq, b, np, hn] queries, [sk, b, ng, hn] keys and values -> [sq, b, np * hn] (or, packed,
        [t, np, hn] and [t, ng, hn] -> [t, np * hn])."""
        if attention_bias is not None:
            raise ValueError("SdpaAttention does not take an attention bias")
        causal = self._causal(attn_mask_type, attention_mask, query, key)
        packed = packed_seq_params if getattr(packed_seq_params, "qkv_format", None) == "thd" else None
        if packed is not None and attention_mask is not None:
            raise ValueError("packed (thd) attention takes its sequences from cu_seqlens, not a mask")
        if _flash_usable(query, attention_mask):
            return self._flash(query, key, value, causal, packed)
        if packed is not None:
            return self._packed_sdpa(query, key, value, causal, packed)
        return self._sdpa(query, key, value, attention_mask, causal)

    def _causal(
        self, attn_mask_type: Any, attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor
    ) -> bool:
        """Whether to apply the causal mask (only without an explicit mask, as Megatron's local softmax)."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"attention_mask must be boolean (True = masked), got {attention_mask.dtype}")
            return False
        if mask_type != AttnMaskType.causal:
            return False
        if query.shape[0] != key.shape[0]:
            raise ValueError(f"the causal mask needs sq == sk, got {query.shape[0]} and {key.shape[0]}")
        return True

    def _expand_kv(self, tensor: torch.Tensor, head_dim: int, native: bool) -> torch.Tensor:
        """Repeat each key/value group for its query heads (Megatron's grouping of heads), unless SDPA
        takes the groups natively."""
        repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        return tensor.repeat_interleave(repeats, dim=head_dim) if repeats > 1 and not native else tensor

    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        # [s, b, n, hn] -> [b, n, s, hn]
        gqa = native_gqa(query, attention_mask)
        k, v = self._expand_kv(key, 2, gqa), self._expand_kv(value, 2, gqa)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, k, v))
        mask = None if attention_mask is None else ~attention_mask
        with _fused_kernels_only(query):
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=0.0,
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed_sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        causal: bool,
        packed: Any,
    ) -> torch.Tensor:
        """Packed [t, n, hn] sequences attended one at a time (the path without flash-attn)."""
        gqa = native_gqa(query, None)
        k, v = self._expand_kv(key, 1, gqa), self._expand_kv(value, 1, gqa)
        cu_q, cu_kv, _, _ = _packed_lengths(packed)
        bounds_q, bounds_kv = cu_q.tolist(), cu_kv.tolist()
        parts = []
        with _fused_kernels_only(query):
            for i in range(len(bounds_q) - 1):
                q_i = query[bounds_q[i] : bounds_q[i + 1]].transpose(0, 1)
                k_i = k[bounds_kv[i] : bounds_kv[i + 1]].transpose(0, 1)
                v_i = v[bounds_kv[i] : bounds_kv[i + 1]].transpose(0, 1)
                if causal and q_i.shape[1] != k_i.shape[1]:
                    raise ValueError("the causal mask needs equal query and key lengths per sequence")
                out = F.scaled_dot_product_attention(
                    q_i, k_i, v_i, dropout_p=0.0, is_causal=causal, scale=self.softmax_scale, enable_gqa=gqa
                )
                parts.append(out.transpose(0, 1))
        return torch.cat(parts).reshape(query.shape[0], self.hidden_size_per_partition)

    def _flash(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        causal: bool,
        packed: Any,
    ) -> torch.Tensor:
        """flash-attn's varlen kernel over [t, n, hn] tokens (GQA native): packed sequences by their
        cumulative lengths, sbhd rows as b sequences of s tokens. CUDA bf16/fp16 only, so this path runs
        on a GPU with flash_attn installed and never on a CPU machine."""
        assert flash_attn_varlen_func is not None
        if packed is not None:
            q, k, v = query, key, value
            cu_q, cu_kv, max_q, max_kv = _packed_lengths(packed)
        else:  # [s, b, n, hn] -> [b * s, n, hn]: row i is the sequence cu[i]..cu[i + 1]
            q, k, v = (t.transpose(0, 1).reshape(-1, t.shape[2], t.shape[3]) for t in (query, key, value))
            sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
            cu_q, cu_kv, max_q, max_kv = _row_lengths(b, sq, q.device), _row_lengths(b, sk, q.device), sq, sk
        out = flash_attn_varlen_func(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            cu_q.to(torch.int32),
            cu_kv.to(torch.int32),
            max_q,
            max_kv,
            dropout_p=0.0,
            softmax_scale=self.softmax_scale,
            causal=causal,
        )
        if packed is not None:
            return out.reshape(out.shape[0], self.hidden_size_per_partition)  # type: ignore[no-any-return]
        sq, b = query.shape[0], query.shape[1]
        return out.reshape(b, sq, self.hidden_size_per_partition).transpose(0, 1).contiguous()  # type: ignore[no-any-return]


def _row_lengths(rows: int, length: int, device: torch.device) -> torch.Tensor:
    """Cumulative lengths of `rows` rows of `length` tokens each."""
    return torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=device)


def _packed_lengths(params: Any) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv) of packed sequences without padding."""
    for padded, plain in (
        (params.cu_seqlens_q_padded, params.cu_seqlens_q),
        (params.cu_seqlens_kv_padded, params.cu_seqlens_kv),
    ):
        if padded is not None and not torch.equal(padded, plain):
            raise ValueError("packed attention does not support padded sequence offsets")
    cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
    max_q = params.max_seqlen_q or int((cu_q[1:] - cu_q[:-1]).max())
    max_kv = params.max_seqlen_kv or int((cu_kv[1:] - cu_kv[:-1]).max())
    return cu_q, cu_kv, int(max_q), int(max_kv)


def _flash_usable(query: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    return (
        flash_attn_varlen_func is not None
        and query.is_cuda
        and query.dtype in _FLASH_DTYPES
        and attention_mask is None
        and query.shape[-1] <= _FLASH_MAX_HEAD_DIM
    )


def native_gqa(query: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether SDPA takes the key/value groups as they are (`enable_gqa`) rather than repeated per query
    head: always off CUDA; on CUDA only where the flash kernel applies (bf16/fp16, no mask, head
    dim <= 256), the one fused CUDA kernel with grouped heads (the others would fall back to the math
    kernel)."""
    if not query.is_cuda:
        return True
    return query.dtype in _FLASH_DTYPES and attention_mask is None and query.shape[-1] <= _FLASH_MAX_HEAD_DIM


def _fused_kernels_only(query: torch.Tensor) -> Any:
    """On CUDA, SDPA limited to the kernels that keep no [s, s] scores; elsewhere no restriction."""
    import contextlib

    if not query.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    )


def local_layer_spec(attention: str, qk_layernorm: bool = False) -> Any:
    """Megatron's local GPT layer spec with the core attention `attention` ('sdpa' or 'unfused'), and per-head
    q/k norms with `qk_layernorm` (Qwen3)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm)
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec
