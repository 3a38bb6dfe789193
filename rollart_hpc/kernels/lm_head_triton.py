"""Triton kernels: LM-head log-prob by online log-sum-exp over vocabulary tiles, SPO++ loss epilogue, and
the recomputing backward. Same operations and signatures as `lm_head_reference` (see `common`).

Forward, two launches:
  1. `_partial_lse_kernel`, grid (token tiles, vocabulary splits): each program computes logits tiles
     [block_t, block_v] = hidden @ weight.T with `tl.dot` over hidden-size steps, and keeps per token only a
     running max m, sum s = sum exp(x - m), shifted entropy sum e = sum exp(x - m) (x - m), and the target
     logit (found in exactly one split). No more than one tile of logits exists at any time.
  2. `_combine_loss_kernel`, grid (token tiles): merges the splits into lse / logprob / entropy and
     evaluates the per-token SPO++ terms of `token_loss.ppo_token_terms` and d loss_t / d logp_t.
Backward: for each (token chunk, vocabulary chunk) `_dlogits_kernel` recomputes the logits tiles and writes
d logits = g (onehot - softmax) for that chunk only, in the input dtype; two GEMMs then accumulate
d hidden += d logits @ weight[chunk] and d weight[chunk] += d logits.T @ hidden (float32 accumulators).
Tokens with g = 0 (masked, clipped or dual-clipped) are dropped before the backward.

Vocabulary-parallel, padded heads (`train.lm_head`): `shard_partials` runs launch 1 alone over the first
`num_real` rows of a head shard (the columns at or beyond `num_real` are masked to -inf inside the kernel, so
padding rows are never read) and merges its splits into this shard's log-sum-exp, target logit and (when
asked) the entropy of its softmax over the shard, which the caller combines over the tensor-parallel group; `grads(..., num_real=...)` recomputes only those rows (the
padding rows' d weight stays 0). A target outside the shard is passed as -1: it matches no column.

Pointer arithmetic assumes contiguous row-major tensors; callers pass `.contiguous()` tensors. Under
`TRITON_INTERPRET=1` the kernels run on CPU tensors (slowly; cost grows with the number of programs).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from rollart_hpc.kernels.common import (
    KernelLossConfig,
    KernelTuning,
    LossInputs,
    TokenForward,
    check_shapes,
    next_pow2,
)

DLOGITS_BUDGET_ELEMENTS = 1 << 28  # d logits chunk: 512 MiB in bf16


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _logits_tile(
    h_ptr,
    w_ptr,
    rows,
    cols,
    row_ok,
    col_ok,
    HID,
    BT: tl.constexpr,
    BV: tl.constexpr,
    BH: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    row_off = rows.to(tl.int64)[:, None] * HID
    col_off = cols.to(tl.int64)[None, :] * HID
    for k0 in range(0, HID, BH):
        ks = k0 + tl.arange(0, BH)
        k_ok = ks < HID
        h = tl.load(h_ptr + row_off + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + col_off + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 tiles as raw uint16 bits
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=PREC)
    return acc


@triton.jit
def _partial_lse_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    m_ptr,
    s_ptr,
    e_ptr,
    x_ptr,
    T,
    V,
    HID,
    split_size,
    BT: tl.constexpr,
    BV: tl.constexpr,
    BH: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    row_ok = rows < T
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    m = tl.full([BT], float("-inf"), tl.float32)
    s = tl.zeros([BT], dtype=tl.float32)
    e = tl.zeros([BT], dtype=tl.float32)
    x_tgt = tl.zeros([BT], dtype=tl.float32)
    v_start = pid_s * split_size
    v_end = tl.minimum(v_start + split_size, V)
    for v0 in range(v_start, v_end, BV):
        cols = v0 + tl.arange(0, BV)
        col_ok = cols < v_end
        logits = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, HID, BT, BV, BH, PREC, UPCAST)
        logits = tl.where(col_ok[None, :], logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(logits - m_new[:, None])
        if WITH_ENTROPY:
            shift = tl.where(m == float("-inf"), 0.0, m - m_new)
            centred = p * tl.where(col_ok[None, :], logits - m_new[:, None], 0.0)
            e = alpha * (e + s * shift) + tl.sum(centred, 1)
        s = s * alpha + tl.sum(p, 1)
        x_tgt += tl.sum(tl.where(cols[None, :] == tgt[:, None], logits, 0.0), 1)
        m = m_new
    out = pid_s * T + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(x_ptr + out, x_tgt, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(e_ptr + out, e, mask=row_ok)


@triton.jit
def _merge_splits(
    m_ptr, s_ptr, e_ptr, x_ptr, rows, row_ok, T, NSPLIT, BT: tl.constexpr, WITH_ENTROPY: tl.constexpr
):
    big_m = tl.full([BT], float("-inf"), tl.float32)
    for i in range(0, NSPLIT):
        big_m = tl.maximum(big_m, tl.load(m_ptr + i * T + rows, mask=row_ok, other=0.0))
    s = tl.zeros([BT], dtype=tl.float32)
    e = tl.zeros([BT], dtype=tl.float32)
    x_tgt = tl.zeros([BT], dtype=tl.float32)
    for i in range(0, NSPLIT):
        m_i = tl.load(m_ptr + i * T + rows, mask=row_ok, other=0.0)
        s_i = tl.load(s_ptr + i * T + rows, mask=row_ok, other=1.0)
        scale = tl.exp(m_i - big_m)
        s += s_i * scale
        x_tgt += tl.load(x_ptr + i * T + rows, mask=row_ok, other=0.0)
        if WITH_ENTROPY:
            e_i = tl.load(e_ptr + i * T + rows, mask=row_ok, other=0.0)
            e += scale * (e_i + s_i * (m_i - big_m))
    log_s = tl.log(s)
    lse = big_m + log_s
    logp = tl.minimum(x_tgt - lse, 0.0)
    entropy = log_s - e / s
    return lse, logp, entropy


@triton.jit
def _combine_loss_kernel(
    m_ptr,
    s_ptr,
    e_ptr,
    x_ptr,
    mask_ptr,
    old_ptr,
    behav_ptr,
    adv_ptr,
    logp_ptr,
    lse_ptr,
    ent_ptr,
    loss_ptr,
    coef_ptr,
    w_ptr,
    clip_ptr,
    dual_ptr,
    capped_ptr,
    kl_ptr,
    T,
    NSPLIT,
    clip_low,
    clip_high,
    dual_c,
    is_cap,
    log_clamp,
    BT: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_CAP: tl.constexpr,
    DECOUPLED: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < T
    lse, logp, entropy = _merge_splits(m_ptr, s_ptr, e_ptr, x_ptr, rows, row_ok, T, NSPLIT, BT, WITH_ENTROPY)
    act = tl.load(mask_ptr + rows, mask=row_ok, other=0) != 0
    old = tl.load(old_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    behav = tl.load(behav_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    adv = tl.where(act, tl.load(adv_ptr + rows, mask=row_ok, other=0.0).to(tl.float32), 0.0)
    raw = logp - old
    log_ratio = tl.minimum(tl.maximum(tl.where(act, raw, 0.0), -log_clamp), log_clamp)
    ratio = tl.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    pg = tl.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    dual = tl.zeros([BT], dtype=tl.int1)
    if HAS_DUAL:
        cap = -dual_c * adv
        dual = (adv < 0.0) & (cap < pg)
        pg = tl.where(dual, cap, pg)
    log_w = tl.minimum(tl.maximum(tl.where(act, old - behav, 0.0), -log_clamp), log_clamp)
    w = tl.exp(log_w)
    capped = tl.zeros([BT], dtype=tl.int1)
    if HAS_CAP:
        capped = w > is_cap
        if DECOUPLED:
            w = tl.where(capped, 0.0, w)
        else:
            w = tl.minimum(w, is_cap)
    in_range = (raw >= -log_clamp) & (raw <= log_clamp)
    live = act & (clipped == 0) & (dual == 0) & in_range
    tl.store(logp_ptr + rows, logp, mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(ent_ptr + rows, entropy, mask=row_ok)
    tl.store(loss_ptr + rows, tl.where(act, w * pg, 0.0), mask=row_ok)
    tl.store(coef_ptr + rows, tl.where(live, -adv * ratio * w, 0.0), mask=row_ok)
    tl.store(w_ptr + rows, tl.where(act, w, 0.0), mask=row_ok)
    tl.store(clip_ptr + rows, (clipped & act).to(tl.float32), mask=row_ok)
    tl.store(dual_ptr + rows, (dual & act).to(tl.float32), mask=row_ok)
    tl.store(capped_ptr + rows, (capped & act).to(tl.float32), mask=row_ok)
    tl.store(kl_ptr + rows, tl.where(act, ratio - 1.0 - log_ratio, 0.0), mask=row_ok)


@triton.jit
def _dlogits_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    lse_ptr,
    g_ptr,
    d_ptr,
    T,
    V,
    HID,
    v_offset,
    v_len,
    BT: tl.constexpr,
    BV: tl.constexpr,
    BH: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    row_ok = rows < T
    col_ok = cols < v_len
    logits = _logits_tile(h_ptr, w_ptr, rows, v_offset + cols, row_ok, col_ok, HID, BT, BV, BH, PREC, UPCAST)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    onehot = tl.where((v_offset + cols)[None, :] == tgt[:, None], 1.0, 0.0)
    d = g[:, None] * (onehot - tl.exp(logits - lse[:, None]))
    out = rows.to(tl.int64)[:, None] * v_len + cols[None, :]
    tl.store(d_ptr + out, d.to(d_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float64:
        raise ValueError("the Triton kernels take float32, bfloat16 or float16 inputs, not float64")
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    """Interpreted tl.dot multiplies 16-bit float tiles as raw integers; fp32 is exact for their products."""
    return interpreting() and dtype != torch.float32


def _tile_options(bt: int, bv: int, bh: int, dtype: torch.dtype, tuning: KernelTuning) -> dict[str, Any]:
    """The launch options of the kernels that form logits tiles (`_logits_tile`): tile sizes, dot precision
    and warps/stages."""
    return dict(
        BT=bt,
        BV=bv,
        BH=bh,
        PREC=_precision(dtype),
        UPCAST=_upcast(dtype),
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
    )


def _blocks(tuning: KernelTuning, num_tokens: int, num_vocab: int, hidden_size: int) -> tuple[int, int, int]:
    if interpreting():  # few, large programs: the interpreter's cost is per program
        fallback = (
            min(next_pow2(num_tokens), 64),
            min(next_pow2(num_vocab), 128),
            min(next_pow2(hidden_size), 64),
        )
    else:
        fallback = (128, 128, 64)
    picked = (tuning.block_t, tuning.block_v, tuning.block_h)
    return tuple(max(16, p if p is not None else f) for p, f in zip(picked, fallback, strict=True))  # type: ignore[return-value]


def _num_splits(
    tuning: KernelTuning, num_tiles_t: int, num_vocab: int, block_v: int, device: torch.device
) -> int:
    if tuning.num_vocab_splits is not None:
        wanted = tuning.num_vocab_splits
    elif interpreting() or device.type != "cuda":
        wanted = 1
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        wanted = max(1, -(-4 * sms // num_tiles_t))
    return max(1, min(wanted, triton.cdiv(num_vocab, block_v)))


def _launch_partials(hidden, weight, targets, with_entropy, tuning, num_vocab=None):  # type: ignore[no-untyped-def]
    """Launch 1 over weight rows [0, num_vocab) (all rows by default): columns past it are masked."""
    num_tokens, hidden_size = hidden.shape
    num_vocab = weight.shape[0] if num_vocab is None else num_vocab
    bt, bv, bh = _blocks(tuning, num_tokens, num_vocab, hidden_size)
    tiles_t = triton.cdiv(num_tokens, bt)
    nsplit = _num_splits(tuning, tiles_t, num_vocab, bv, hidden.device)
    split_size = triton.cdiv(triton.cdiv(num_vocab, nsplit), bv) * bv
    nsplit = triton.cdiv(num_vocab, split_size)
    parts = torch.empty(4, nsplit, num_tokens, dtype=torch.float32, device=hidden.device)
    _partial_lse_kernel[(tiles_t, nsplit)](
        hidden,
        weight,
        targets,
        parts[0],
        parts[1],
        parts[2],
        parts[3],
        num_tokens,
        num_vocab,
        hidden_size,
        split_size,
        WITH_ENTROPY=with_entropy,
        **_tile_options(bt, bv, bh, hidden.dtype, tuning),
    )
    return parts, nsplit


def forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inputs: LossInputs,
    cfg: KernelLossConfig,
    with_entropy: bool,
    tuning: KernelTuning,
) -> TokenForward:
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    parts, nsplit = _launch_partials(hidden, weight, targets, with_entropy, tuning)
    num_tokens = hidden.shape[0]
    out = torch.empty(10, num_tokens, dtype=torch.float32, device=hidden.device)
    mask = inputs.action_mask.to(torch.int8).contiguous()
    side = [t.contiguous() for t in inputs[1:]]
    bt = min(next_pow2(max(num_tokens, 1)), 1024)
    _combine_loss_kernel[(triton.cdiv(num_tokens, bt),)](
        parts[0],
        parts[1],
        parts[2],
        parts[3],
        mask,
        *side,
        *out,
        num_tokens,
        nsplit,
        cfg.clip_low,
        cfg.clip_high,
        cfg.dual_clip_c or 0.0,
        cfg.is_cap or 0.0,
        cfg.log_ratio_clamp,
        BT=bt,
        WITH_ENTROPY=with_entropy,
        HAS_DUAL=cfg.dual_clip_c is not None,
        HAS_CAP=cfg.is_cap is not None,
        DECOUPLED=cfg.decoupled,
    )
    logp, lse, entropy, loss, coef, w, clipped, dual, capped, kl = out
    return TokenForward(
        logp, lse, entropy if with_entropy else None, loss, coef, w, clipped, dual, capped, kl
    )


def shard_partials(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    num_real: int,
    tuning: KernelTuning,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per token [T] (fp32), over the first `num_real` rows of this head shard (the rest is padding): the
    log-sum-exp, the target logit (0 where the target is not in [0, num_real), e.g. -1) and, `with_entropy`,
    the entropy of the softmax over this shard alone (else None); as `lm_head_reference.shard_partials`. A
    shard of padding only gives log-sum-exp -inf, entropy 0."""
    check_shapes(hidden, weight, targets)
    if not 0 <= num_real <= weight.shape[0]:
        raise ValueError(f"num_real must lie in [0, {weight.shape[0]}], got {num_real}")
    num_tokens = hidden.shape[0]
    if num_real == 0 or num_tokens == 0:
        lse = torch.full((num_tokens,), float("-inf"), dtype=torch.float32, device=hidden.device)
        zeros = torch.zeros_like(lse)
        return lse, zeros, zeros.clone() if with_entropy else None
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    parts, _ = _launch_partials(hidden, weight, targets, with_entropy, tuning, num_real)
    split_max, split_sum, split_centred, split_target = parts
    top = split_max.amax(0)
    scale = torch.exp(split_max - top)  # every split holds >= 1 column: finite maxima
    total = (split_sum * scale).sum(0)
    entropy = None
    if with_entropy:  # as `_merge_splits`: sum exp(x - top) (x - top) over the shard, then log s - e / s
        centred = (scale * (split_centred + split_sum * (split_max - top))).sum(0)
        entropy = torch.log(total) - centred / total
    return top + torch.log(total), split_target.sum(0), entropy


def _chunks(tuning: KernelTuning, num_tokens: int, num_vocab: int) -> tuple[int, int]:
    token_chunk = tuning.token_chunk or num_tokens
    vocab_chunk = tuning.vocab_chunk or max(1, DLOGITS_BUDGET_ELEMENTS // max(token_chunk, 1))
    return max(1, min(token_chunk, num_tokens)), max(1, min(vocab_chunk, num_vocab))


def _vocab_chunk_grads(hidden, weight, targets, lse, g, grad_hidden, v0, v_len, tuning, out):  # type: ignore[no-untyped-def]
    """d weight[v0:v0+v_len] into `out`, accumulating d hidden for that vocabulary chunk in place. With one
    token chunk the GEMM writes `out` directly (it accumulates in fp32 inside); with several, an fp32
    accumulator of the vocabulary chunk sums them first."""
    num_tokens, hidden_size = hidden.shape
    token_chunk, _ = _chunks(tuning, num_tokens, weight.shape[0])
    bt, bv, bh = _blocks(tuning, token_chunk, v_len, hidden_size)
    w_chunk = weight[v0 : v0 + v_len]
    single = token_chunk >= num_tokens
    acc = None if single else torch.zeros(v_len, hidden_size, dtype=torch.float32, device=hidden.device)
    for t0 in range(0, num_tokens, token_chunk):
        t_len = min(token_chunk, num_tokens - t0)
        dlogits = torch.empty(t_len, v_len, dtype=hidden.dtype, device=hidden.device)
        h_chunk = hidden[t0 : t0 + t_len]
        _dlogits_kernel[(triton.cdiv(t_len, bt), triton.cdiv(v_len, bv))](
            h_chunk,
            weight,
            targets[t0:],
            lse[t0:],
            g[t0:],
            dlogits,
            t_len,
            weight.shape[0],
            hidden_size,
            v0,
            v_len,
            **_tile_options(bt, bv, bh, hidden.dtype, tuning),
        )
        grad_hidden[t0 : t0 + t_len] += dlogits @ w_chunk
        if acc is None:
            torch.mm(dlogits.T, h_chunk, out=out)
        else:
            acc += dlogits.T @ h_chunk
    if acc is not None:
        out.copy_(acc)


def grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    tuning: KernelTuning,
    num_real: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """d hidden, d weight for d loss / d logprob = g; only tokens with g != 0 are recomputed. num_real:
    only weight rows [0, num_real) are vocabulary (the d weight of the rest, padding, is 0)."""
    check_shapes(hidden, weight, targets)
    num_real = weight.shape[0] if num_real is None else num_real
    weight = weight.contiguous()
    active = torch.nonzero(g).squeeze(1)
    h_active = hidden.index_select(0, active).contiguous()
    t_active = targets.index_select(0, active).contiguous()
    lse_active = lse.index_select(0, active).float().contiguous()
    g_active = g.index_select(0, active).float().contiguous()
    grad_h_active = torch.zeros(h_active.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.zeros_like(weight)
    if active.numel() > 0 and num_real > 0:
        _, vocab_chunk = _chunks(tuning, active.numel(), num_real)
        for v0 in range(0, num_real, vocab_chunk):
            v_len = min(vocab_chunk, num_real - v0)
            _vocab_chunk_grads(
                h_active, weight, t_active, lse_active, g_active, grad_h_active, v0, v_len, tuning,
                grad_weight[v0 : v0 + v_len],
            )  # fmt: skip
    grad_hidden = torch.zeros_like(hidden)
    grad_hidden.index_copy_(0, active, grad_h_active.to(hidden.dtype))
    return grad_hidden, grad_weight
