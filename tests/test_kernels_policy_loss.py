"""Fused LM-head log-prob + SPO++ loss: both implementations against float64 and the training reference.

The Triton kernels run under TRITON_INTERPRET=1 (set by conftest.py), so shapes stay tiny and tiles are
chosen to produce a handful of programs; small explicit tiles exercise tiles that cross sequence
boundaries, several vocabulary splits and several backward chunks.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollart_hpc.algo.loss import LossConfig, broadcast_to_tokens, packed_policy_loss
from rollart_hpc.kernels import (
    KernelLossConfig,
    KernelTuning,
    LossInputs,
    eager_policy_loss,
    fused_policy_loss,
    linear_logprob,
)

IMPLS = ("triton", "torch")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
SMALL_TILES = KernelTuning(
    block_t=16, block_v=32, block_h=16, num_vocab_splits=3, token_chunk=24, vocab_chunk=40
)
# log-ratio boundaries of the default config: clip at log 0.8 and log 1.28, dual-clip at log 2
BOUNDARIES = (math.log(0.8), math.log(1.28), math.log(2.0))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _log_ratios(n: int, gen: torch.Generator) -> torch.Tensor:
    """Offsets old - logp in [-1, 1], kept 0.03 away from the branch boundaries so rounding never flips one."""
    r = torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1
    for b in BOUNDARIES:
        near = (r + b).abs() < 0.03
        r = torch.where(near, r + 0.07, r)
    return r


def _problem(seed: int, nt: int, nh: int, nv: int, dtype: torch.dtype, scale: float = 1.0) -> dict:
    """Packed random problem; old log-probs sit at known offsets from the float64 log-probs."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(nt, nh, generator=gen) * scale).to(dtype)
    weight = (torch.randn(nv, nh, generator=gen) * nh**-0.5 * 2).to(dtype)
    targets = torch.randint(0, nv, (nt,), generator=gen)
    cuts = torch.sort(torch.randint(1, nt, (3,), generator=gen)).values
    cu_seqlens = torch.cat([torch.tensor([0]), cuts, torch.tensor([nt])])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    # observation tokens first in each trajectory, then actions: the mask is 0/1 runs, not iid
    mask = torch.cat([torch.arange(n) >= n // 3 for n in lengths])
    logits = hidden.double() @ weight.double().T
    logp = torch.log_softmax(logits, 1).gather(1, targets[:, None]).squeeze(1)
    old = logp - _log_ratios(nt, gen)
    behaviour = old - (torch.rand(nt, generator=gen, dtype=torch.float64) * 1.6 - 0.5)
    traj_adv = torch.randn(len(lengths), generator=gen, dtype=torch.float64)
    return {
        "hidden": hidden,
        "weight": weight,
        "targets": targets,
        "mask": mask,
        "cu_seqlens": cu_seqlens,
        "old": old.float(),
        "behaviour": behaviour.float(),
        "traj_adv": traj_adv.float(),
        "adv": broadcast_to_tokens(traj_adv, cu_seqlens).float(),
        "denom": int(mask.sum()) + 5,
    }


def _fused(
    p: dict, impl: str, cfg: KernelLossConfig, tuning: KernelTuning | None = None, entropy: bool = False
):
    hidden = p["hidden"].clone().requires_grad_(True)
    weight = p["weight"].clone().requires_grad_(True)
    loss, logp, diag = fused_policy_loss(
        hidden,
        weight,
        p["targets"],
        p["mask"],
        p["old"],
        p["behaviour"],
        p["adv"],
        p["denom"],
        cfg,
        impl=impl,
        with_entropy=entropy,
        tuning=tuning,
    )
    loss.backward()
    return loss.detach(), logp, hidden.grad, weight.grad, diag


def _float64_reference(p: dict, cfg: KernelLossConfig):
    hidden = p["hidden"].double().requires_grad_(True)
    weight = p["weight"].double().requires_grad_(True)
    inputs = LossInputs(p["mask"], p["old"].double(), p["behaviour"].double(), p["adv"].double())
    loss, logp = eager_policy_loss(hidden, weight, p["targets"], inputs, p["denom"], cfg)
    loss.backward()
    return loss.detach(), logp, hidden.grad, weight.grad


CASES = [  # (seed, T, H, V, tuning)
    (1, 64, 32, 100, None),
    (2, 53, 24, 77, SMALL_TILES),
    (3, 37, 16, 65, KernelTuning(block_t=32, block_v=16, block_h=16, num_vocab_splits=2, vocab_chunk=33)),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[1]}H{c[2]}V{c[3]}" for c in CASES])
def test_parity_with_float64(impl: str, dtype: torch.dtype, case: tuple) -> None:
    seed, nt, nh, nv, tuning = case
    if impl == "torch" and tuning is not None:
        tuning = KernelTuning(token_chunk=tuning.token_chunk or 16)
    p = _problem(seed, nt, nh, nv, dtype)
    got = _fused(p, impl, KernelLossConfig(), tuning)
    ref = _float64_reference(p, KernelLossConfig())
    for name, g, r in zip(("loss", "logprobs", "d hidden", "d weight"), got[:4], ref, strict=True):
        assert g.dtype == (torch.float32 if name in ("loss", "logprobs") else dtype)
        assert _rel_err(g, r) <= TOL[dtype], (name, _rel_err(g, r))
    assert bool((got[1] <= 0).all())


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(dual_clip_c=10.0),
        LossConfig(decoupled=True),
        LossConfig(dual_clip_c=None, is_cap=None),
    ],
    ids=["spo++", "spo", "decoupled", "plain"],
)
def test_triton_equals_packed_policy_loss(cfg: LossConfig) -> None:
    """Loss, gradient and every diagnostic of the kernel equal the training reference on the same inputs."""
    p = _problem(7, 48, 16, 90, torch.float32)
    loss, logp, grad_h, _, diag = _fused(p, "triton", cfg)
    hidden = p["hidden"].double().requires_grad_(True)
    ref_logp = (
        torch.log_softmax(hidden @ p["weight"].double().T, 1).gather(1, p["targets"][:, None]).squeeze(1)
    )
    ref_loss, ref = packed_policy_loss(
        ref_logp,
        p["old"].double(),
        p["behaviour"].double(),
        p["traj_adv"].double(),
        p["cu_seqlens"],
        p["mask"],
        p["denom"],
        cfg,
    )
    ref_loss.backward()
    assert _rel_err(loss, ref_loss) <= 1e-5 and _rel_err(grad_h, hidden.grad) <= 1e-4
    for name in (
        "approx_kl",
        "clip_fraction",
        "dual_clip_fraction",
        "is_capped_fraction",
        "is_weight",
        "max_abs_advantage",
    ):
        torch.testing.assert_close(
            getattr(diag, name).double(), getattr(ref, name).double(), atol=1e-6, rtol=1e-4
        )
    assert diag.num_action_tokens == ref.num_action_tokens
    assert float(ref.clip_fraction) > 0 and (cfg.is_cap is None or float(ref.is_capped_fraction) > 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_tokens_contribute_nothing(impl: str) -> None:
    """Garbage (inf, NaN) in masked positions changes nothing; their hidden rows get zero gradient."""
    p = _problem(11, 40, 16, 70, torch.float32)
    clean = _fused(p, impl, KernelLossConfig())
    off = ~p["mask"]
    for key, value in (("old", math.inf), ("behaviour", -math.inf), ("adv", math.nan)):
        p[key] = torch.where(off, torch.full_like(p[key], value), p[key])
    dirty = _fused(p, impl, KernelLossConfig())
    for c, d in zip(clean[:4], dirty[:4], strict=True):
        torch.testing.assert_close(c, d, rtol=0, atol=0)
    assert bool((dirty[2][off] == 0).all()) and bool(torch.isfinite(dirty[3]).all())
    only_masked = dict(p, mask=torch.zeros_like(p["mask"]))
    loss, _, grad_h, grad_w, diag = _fused(only_masked, impl, KernelLossConfig())
    assert float(loss) == 0.0 and not grad_h.any() and not grad_w.any() and diag.num_action_tokens == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_extreme_logits_stay_finite(impl: str) -> None:
    """Logits of order 1e4 (one token near-certain per row): no NaN/Inf anywhere, log-probs <= 0."""
    p = _problem(13, 32, 16, 50, torch.float32, scale=2000.0)
    p["old"] = torch.full_like(p["old"], -3.0)
    p["behaviour"] = torch.full_like(p["behaviour"], -3.0)
    loss, logp, grad_h, grad_w, diag = _fused(p, impl, KernelLossConfig(), entropy=True)
    for t in (loss, logp, grad_h, grad_w, diag.token_entropy, diag.approx_kl):
        assert bool(torch.isfinite(t).all())
    assert bool((logp <= 0).all()) and float(logp.min()) < -1000
    assert bool((diag.token_entropy >= -1e-4).all())


def test_entropy_matches_softmax_entropy() -> None:
    p = _problem(17, 48, 32, 99, torch.float32)
    _, _, _, _, fused = _fused(p, "triton", KernelLossConfig(), SMALL_TILES, entropy=True)
    _, _, _, _, torch_ref = _fused(p, "torch", KernelLossConfig(), entropy=True)
    logits = p["hidden"].double() @ p["weight"].double().T
    expected = -(torch.softmax(logits, 1) * torch.log_softmax(logits, 1)).sum(1)
    assert (
        _rel_err(fused.token_entropy, expected) <= 1e-5
        and _rel_err(torch_ref.token_entropy, expected) <= 1e-5
    )
    expected_sum = expected[p["mask"]].sum() / p["denom"]
    torch.testing.assert_close(fused.entropy.double(), expected_sum, rtol=1e-5, atol=0)


def test_micro_batches_sum_to_the_batch() -> None:
    """With the global denominator, losses and gradients of two halves add up to those of the whole."""
    p = _problem(19, 48, 16, 60, torch.float32)
    whole = _fused(p, "triton", KernelLossConfig())
    halves = []
    for sl in (slice(0, 20), slice(20, 48)):
        part = {
            k: (v[sl] if k in ("hidden", "targets", "mask", "old", "behaviour", "adv") else v)
            for k, v in p.items()
        }
        halves.append(_fused(part, "triton", KernelLossConfig()))
    torch.testing.assert_close(halves[0][0] + halves[1][0], whole[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.cat([halves[0][2], halves[1][2]]), whole[2], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(halves[0][3] + halves[1][3], whole[3], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_linear_logprob_gradient_for_any_upstream(impl: str) -> None:
    p = _problem(23, 30, 16, 45, torch.float32)
    upstream = torch.randn(30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    hidden = p["hidden"].clone().requires_grad_(True)
    weight = p["weight"].clone().requires_grad_(True)
    logp = linear_logprob(
        hidden, weight, p["targets"], impl=impl, tuning=SMALL_TILES if impl == "triton" else None
    )
    (logp.double() * upstream).sum().backward()
    h64 = p["hidden"].double().requires_grad_(True)
    w64 = p["weight"].double().requires_grad_(True)
    ref = torch.log_softmax(h64 @ w64.T, 1).gather(1, p["targets"][:, None]).squeeze(1)
    (ref * upstream).sum().backward()
    assert _rel_err(logp, ref) <= 1e-5
    assert _rel_err(hidden.grad, h64.grad) <= 1e-4 and _rel_err(weight.grad, w64.grad) <= 1e-4


@pytest.mark.parametrize("impl", IMPLS)
def test_policy_loss_entry_point_selects_the_fused_path(impl: str) -> None:
    """`algo.loss.policy_loss` on LMHeadInputs (fused) equals it on the token log-probs (torch reference)."""
    from rollart_hpc.algo.loss import LMHeadInputs, policy_loss

    p = _problem(29, 40, 16, 70, torch.float32)
    batch = LossInputs(p["mask"], p["old"], p["behaviour"], p["adv"])
    cfg = LossConfig(dual_clip_c=3.0)
    hidden = p["hidden"].clone().requires_grad_(True)
    source = LMHeadInputs(hidden, p["weight"], p["targets"], impl=impl, with_entropy=True)
    loss, diag = policy_loss(source, batch, cfg, p["denom"], p["old"])
    loss.backward()
    h64 = p["hidden"].double().requires_grad_(True)
    logp = torch.log_softmax(h64 @ p["weight"].double().T, 1).gather(1, p["targets"][:, None]).squeeze(1)
    ref_loss, ref = policy_loss(logp, batch, cfg, p["denom"], p["old"].double())
    ref_loss.backward()
    assert _rel_err(loss, ref_loss) <= 1e-5 and _rel_err(hidden.grad, h64.grad) <= 1e-4
    for name in ("approx_kl", "clip_fraction", "is_capped_fraction", "is_weight", "max_abs_advantage"):
        torch.testing.assert_close(
            getattr(diag, name).double(), getattr(ref, name).double(), atol=1e-6, rtol=1e-4
        )
    assert diag.entropy is not None and ref.entropy is None
    # old_logprobs=None: the proximal policy is the current one, so every ratio is 1 and nothing is clipped
    current, diag_now = policy_loss(source, batch, cfg, p["denom"])
    assert float(diag_now.clip_fraction) == 0.0 and abs(float(diag_now.approx_kl)) < 1e-6
    assert torch.isfinite(current)


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(loss_agg="seq_mean_token_mean", decoupled=True),
        LossConfig(loss_agg="seq_mean_token_sum_norm", loss_agg_tokens=20, dual_clip_c=None, is_cap=None),
        LossConfig(clip_low=3e-4, clip_high=4e-4, ratio_level="sequence", loss_agg="seq_mean_token_mean"),
        LossConfig(is_level="sequence", is_cap=1.5, is_reject_low=0.5, is_reject_high=2.5),
        LossConfig(is_cap=None, is_reject_low=0.7, is_reject_high=1.6),
    ],
    ids=["seq_mean_decoupled", "dr_grpo_sum_norm", "gspo", "seq_is_reject", "token_reject"],
)
def test_fused_path_equals_eager_for_every_loss_switch(cfg: LossConfig) -> None:
    """`policy_loss` on LMHeadInputs (fused head; sequence-level terms in torch on its log-probs) has the
    loss and hidden-state / weight gradients of the full-logits float64 path, for each new setting."""
    from rollart_hpc.algo.loss import LMHeadInputs, SequenceBatch, policy_loss

    p = _problem(31, 40, 16, 70, torch.float32)
    batch = SequenceBatch(p["mask"], p["behaviour"], p["adv"], p["cu_seqlens"])
    hidden = p["hidden"].clone().requires_grad_(True)
    weight = p["weight"].clone().requires_grad_(True)
    source = LMHeadInputs(hidden, weight, p["targets"], impl="triton", tuning=SMALL_TILES)
    loss, diag = policy_loss(source, batch, cfg, p["denom"], p["old"], 6)
    loss.backward()
    h64 = p["hidden"].double().requires_grad_(True)
    w64 = p["weight"].double().requires_grad_(True)
    logp = torch.log_softmax(h64 @ w64.T, 1).gather(1, p["targets"][:, None]).squeeze(1)
    ref_loss, ref = policy_loss(logp, batch, cfg, p["denom"], p["old"].double(), 6)
    ref_loss.backward()
    assert _rel_err(loss, ref_loss) <= 1e-5
    assert _rel_err(hidden.grad, h64.grad) <= 1e-4 and _rel_err(weight.grad, w64.grad) <= 1e-4
    assert float(h64.grad.abs().sum()) > 0
    torch.testing.assert_close(diag.is_rejected_fraction.double(), ref.is_rejected_fraction.double())
    if not cfg.in_kernel or cfg.loss_agg != "token_mean":  # the kernels' own entry refuses, never ignores
        with pytest.raises(ValueError, match="token_loss|policy_loss"):
            inputs = LossInputs(p["mask"], p["old"], p["behaviour"], p["adv"])
            fused_policy_loss(p["hidden"], p["weight"], p["targets"], *inputs, p["denom"], cfg)


def test_head_entropy_and_its_gradient_sharded_and_padded() -> None:
    """`head_entropy` on a vocabulary split into two shards (the last rows padding), combined by an
    in-process reduce, equals the float64 softmax entropy of the real columns, values and gradients."""
    from rollart_hpc.kernels import head_entropy

    p = _problem(37, 21, 16, 50, torch.float64)
    upstream = torch.randn(21, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    real = 44  # rows 44..49 are padding
    h64, w64 = p["hidden"].clone().requires_grad_(True), p["weight"].clone().requires_grad_(True)
    logits = (h64 @ w64.T)[:, :real]
    expected = -(torch.softmax(logits, 1) * torch.log_softmax(logits, 1)).sum(1)
    (expected * upstream).sum().backward()
    hidden, weight = p["hidden"].clone().requires_grad_(True), p["weight"].clone().requires_grad_(True)
    shards = weight[:25], weight[25:]
    # An in-process stand-in for the group's all-reduce: it hands each shard what the group agrees on
    # (max, sum of exp, sum of p x over the whole real vocabulary), computed here from the whole head.
    with torch.no_grad():
        full = (p["hidden"] @ p["weight"].T)[:, :real]
        top = full.amax(1)
        total = torch.exp(full - top[:, None]).sum(1)
        dot = (torch.exp(full - top[:, None]) * (full - top[:, None])).sum(1)
    calls = iter([top, total, dot] * 2)

    def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        t.copy_(next(calls))
        return t

    parts = [
        head_entropy(hidden, shards[0], 25, reduce, 8),
        head_entropy(hidden, shards[1], real - 25, reduce, 8),
    ]
    torch.testing.assert_close(parts[0], expected.detach(), rtol=1e-10, atol=1e-12)
    (parts[0] * upstream).sum().backward(retain_graph=True)
    (parts[1] * upstream).sum().backward()  # each shard's hidden gradient is its part: they add up
    torch.testing.assert_close(hidden.grad, h64.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(weight.grad, w64.grad, rtol=1e-9, atol=1e-12)
    assert float(weight.grad[real:].abs().max()) == 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_entropy_bonus_fused_equals_eager(impl: str) -> None:
    """entropy_coef > 0: `policy_loss` on LMHeadInputs subtracts coef x the entropy (aggregated as the
    loss) with the gradients of the full-logits float64 path; the entropy diagnostic is the token mean."""
    from rollart_hpc.algo.loss import LMHeadInputs, SequenceBatch, policy_loss

    p = _problem(41, 40, 16, 70, torch.float32)
    batch = SequenceBatch(p["mask"], p["behaviour"], p["adv"], p["cu_seqlens"])
    cfg = LossConfig(entropy_coef=0.3, loss_agg="seq_mean_token_mean")
    hidden = p["hidden"].clone().requires_grad_(True)
    weight = p["weight"].clone().requires_grad_(True)
    tuning = SMALL_TILES if impl == "triton" else None
    source = LMHeadInputs(hidden, weight, p["targets"], impl=impl, tuning=tuning)
    loss, diag = policy_loss(source, batch, cfg, p["denom"], p["old"], 6)
    loss.backward()
    h64 = p["hidden"].double().requires_grad_(True)
    w64 = p["weight"].double().requires_grad_(True)
    logits = h64 @ w64.T
    logp = torch.log_softmax(logits, 1).gather(1, p["targets"][:, None]).squeeze(1)
    entropy = -(torch.softmax(logits, 1) * torch.log_softmax(logits, 1)).sum(1)
    ref_loss, ref = policy_loss(logp, batch, cfg, p["denom"], p["old"].double(), 6, entropy)
    ref_loss.backward()
    no_bonus, _ = policy_loss(
        logp, batch, LossConfig(loss_agg="seq_mean_token_mean"), p["denom"], p["old"].double(), 6
    )
    assert abs(float((ref_loss - no_bonus).detach())) > 1e-3  # the bonus changes the loss
    assert _rel_err(loss, ref_loss) <= 1e-5
    assert _rel_err(hidden.grad, h64.grad) <= 1e-4 and _rel_err(weight.grad, w64.grad) <= 1e-4
    expected = entropy.detach()[p["mask"]].sum() / p["denom"]
    torch.testing.assert_close(diag.entropy.double(), expected, rtol=1e-5, atol=0)
