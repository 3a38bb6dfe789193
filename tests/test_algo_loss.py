"""Packed PPO loss: per-token formulas, split invariance, masked tokens, gradcheck."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart_hpc.algo import (
    LossConfig,
    LossDiagnostics,
    SequenceBatch,
    broadcast_to_tokens,
    packed_policy_loss,
    policy_loss,
    ppo_token_terms,
)
from rollart_hpc.kernels import KernelLossConfig, LossInputs
from rollart_hpc.kernels.token_loss import kl_estimate, reward_to_go

CONFIGS = {
    "spo++": LossConfig(),
    "spo": LossConfig(dual_clip_c=10.0),
    "decoupled": LossConfig(decoupled=True),
    "plain": LossConfig(dual_clip_c=None, is_cap=None),
}
# Settings that read trajectories: sequence-level ratio / weight, rejection, per-trajectory aggregations.
SEQ_CONFIGS = {
    "seq_mean_token_mean": LossConfig(loss_agg="seq_mean_token_mean"),
    "seq_mean_token_sum_norm": LossConfig(loss_agg="seq_mean_token_sum_norm", loss_agg_tokens=12),
    "gspo": LossConfig(
        clip_low=3e-4,
        clip_high=4e-4,
        ratio_level="sequence",
        loss_agg="seq_mean_token_mean",
        dual_clip_c=None,
    ),
    "seq_is_reject": LossConfig(is_level="sequence", is_cap=1.5, is_reject_low=0.5, is_reject_high=3.0),
    "token_reject": LossConfig(is_cap=None, is_reject_low=0.6, is_reject_high=1.8),
}
ALL_CONFIGS = CONFIGS | SEQ_CONFIGS


def _scalar_reference(lp: float, old: float, behav: float, adv: float, cfg: LossConfig) -> float:
    """verl's per-token formula written with plain floats, independently of the torch code."""
    ratio = math.exp(lp - old)
    pg = max(-adv * ratio, -adv * min(max(ratio, 1 - cfg.clip_low), 1 + cfg.clip_high))
    if cfg.dual_clip_c is not None and adv < 0:
        pg = min(pg, -cfg.dual_clip_c * adv)
    w = math.exp(old - behav)
    if cfg.is_cap is not None:
        w = (0.0 if w > cfg.is_cap else w) if cfg.decoupled else min(w, cfg.is_cap)
    return w * pg


def test_token_terms_by_hand() -> None:
    lp = torch.tensor([0.5, 1.5, -math.log(2), 0.0, 0.0, 0.1])
    old = torch.zeros(6)
    behav = torch.tensor([0.0, 0.0, 0.0, -math.log(3), -math.log(1.5), 0.0])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([1, 1, 1, 1, 1, 0])
    terms = ppo_token_terms(lp, old, behav, adv, mask, LossConfig())
    # ratio e^0.5 > 1.28, A > 0: clipped at -1.28; ratio e^1.5 = 4.48, A < 0: dual-clip caps 4.48 at 2;
    # ratio 0.5, A < 0: clipped to 0.8; ratio 1, weight 3 truncated to 2; weight 1.5 kept; masked -> 0.
    expected = torch.tensor([-1.28, 2.0, 0.8, -2.0, -1.5, 0.0])
    torch.testing.assert_close(terms.loss, expected)
    assert terms.clipped.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert terms.dual_clipped.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert terms.is_capped.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(terms.approx_kl[0], torch.tensor(math.exp(0.5) - 1.5))
    decoupled = ppo_token_terms(lp, old, behav, adv, mask, LossConfig(decoupled=True))
    assert decoupled.loss[3] == 0.0 and decoupled.is_weight[3] == 0.0
    torch.testing.assert_close(decoupled.loss[4], torch.tensor(-1.5))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_token_terms_match_scalar_reference(name: str) -> None:
    cfg = CONFIGS[name]
    gen = torch.Generator().manual_seed(5)
    lp, old, behav = (torch.randn(400, generator=gen, dtype=torch.float64) * 0.6 for _ in range(3))
    adv = torch.randn(400, generator=gen, dtype=torch.float64)
    terms = ppo_token_terms(lp, old, behav, adv, torch.ones(400), cfg)
    expected = [_scalar_reference(*map(float, row), cfg) for row in zip(lp, old, behav, adv, strict=True)]
    torch.testing.assert_close(terms.loss, torch.tensor(expected, dtype=torch.float64))


def test_broadcast_to_tokens_and_cu_seqlens_checks() -> None:
    cu = torch.tensor([0, 2, 2, 5])
    out = broadcast_to_tokens(torch.tensor([1.0, 7.0, -3.0]), cu)
    assert out.tolist() == [1.0, 1.0, -3.0, -3.0, -3.0]
    with pytest.raises(ValueError, match="trajectories"):
        broadcast_to_tokens(torch.tensor([1.0, 2.0]), cu)
    with pytest.raises(ValueError, match="non-decreasing"):
        broadcast_to_tokens(torch.tensor([1.0, 2.0]), torch.tensor([0, 3, 2]))
    lp = torch.zeros(5)
    with pytest.raises(ValueError, match="from 0 to T"):
        packed_policy_loss(
            lp, lp, lp, torch.zeros(2), torch.tensor([0, 2, 4]), torch.ones(5), 5, LossConfig()
        )


class _Batch:
    """A packed batch whose log-probs come from a tiny shared model: logp = -softplus(x @ theta)."""

    def __init__(self, lengths: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        total = sum(lengths)
        self.lengths = lengths
        self.features = torch.randn(total, 3, generator=gen, dtype=torch.float64)
        self.theta = torch.randn(3, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            base = -torch.nn.functional.softplus(self.features @ self.theta)
        self.old = base + 0.3 * torch.randn(total, generator=gen, dtype=torch.float64)
        self.behaviour = self.old + 0.5 * torch.randn(total, generator=gen, dtype=torch.float64)
        self.advantages = torch.randn(len(lengths), generator=gen, dtype=torch.float64)
        self.mask = torch.rand(total, generator=gen) < 0.7

    def loss(
        self, theta: torch.Tensor, first: int, last: int, num_global: int, cfg: LossConfig
    ) -> torch.Tensor:
        """Loss of trajectories first..last-1 as one micro-batch."""
        starts = [0, *torch.tensor(self.lengths).cumsum(0).tolist()]
        lo, hi = starts[first], starts[last]
        cu = torch.tensor(starts[first : last + 1]) - lo
        logprobs = -torch.nn.functional.softplus(self.features[lo:hi] @ theta)
        loss, _ = packed_policy_loss(
            logprobs,
            self.old[lo:hi],
            self.behaviour[lo:hi],
            self.advantages[first:last],
            cu,
            self.mask[lo:hi],
            num_global,
            cfg,
            self.num_action_sequences(),
        )
        return loss

    def num_action_sequences(self) -> int:
        """The batch's trajectories with an action token (at least 1)."""
        cu = [0, *torch.tensor(self.lengths).cumsum(0).tolist()]
        return max(1, sum(bool(self.mask[a:b].any()) for a, b in zip(cu, cu[1:], strict=False)))


split_cases = st.tuples(
    st.lists(st.integers(0, 9), min_size=1, max_size=8),
    st.lists(st.booleans(), min_size=8, max_size=8),
    st.lists(st.booleans(), min_size=8, max_size=8),
    st.integers(0, 1000),
    st.sampled_from(sorted(ALL_CONFIGS)),
)


@settings(max_examples=40, deadline=None)
@given(split_cases)
def test_loss_and_gradients_do_not_depend_on_micro_batch_or_rank_split(case: tuple) -> None:
    lengths, micro_cuts, rank_cuts, seed, name = case
    batch, cfg = _Batch(lengths, seed), ALL_CONFIGS[name]
    num_global = max(int(batch.mask.sum()), 1)
    theta = batch.theta.clone().requires_grad_(True)
    whole = batch.loss(theta, 0, len(lengths), num_global, cfg)
    (whole_grad,) = torch.autograd.grad(whole, theta)
    # Ranks own contiguous shards of trajectories; each rank splits its shard into micro-batches.
    theta_parts = batch.theta.clone().requires_grad_(True)
    total, start = torch.zeros((), dtype=torch.float64), 0
    for end in range(1, len(lengths) + 1):
        if end == len(lengths) or micro_cuts[end - 1] or rank_cuts[end - 1]:
            part = batch.loss(theta_parts, start, end, num_global, cfg)
            part.backward()  # gradients accumulate, as with micro-batching plus a SUM all-reduce
            total = total + part.detach()
            start = end
    torch.testing.assert_close(total, whole.detach(), atol=1e-6, rtol=0)
    assert theta_parts.grad is not None
    torch.testing.assert_close(theta_parts.grad, whole_grad, atol=1e-6, rtol=0)


def test_observation_tokens_get_no_gradient_even_with_garbage() -> None:
    mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
    logprobs = torch.tensor([-0.5, 80.0, -1.2, -1e9, 3.0, -0.1], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-0.4, float("nan"), -1.0, 50.0, float("inf"), -0.3], dtype=torch.float64)
    behaviour = torch.tensor([-0.6, float("-inf"), -1.1, float("nan"), 0.0, -0.2], dtype=torch.float64)
    loss, out = packed_policy_loss(
        logprobs, old, behaviour, torch.tensor([1.0, -2.0]), torch.tensor([0, 3, 6]), mask, 3, LossConfig()
    )
    loss.backward()
    assert logprobs.grad is not None
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[~mask].tolist() == [0.0, 0.0, 0.0]
    assert (logprobs.grad[mask] != 0).all()
    assert torch.isfinite(out.approx_kl) and torch.isfinite(out.is_weight) and out.num_action_tokens == 3


any_float = st.floats(allow_nan=True, allow_infinity=True, width=64)
masked_cases = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        *(st.lists(st.floats(-3.0, 0.0), min_size=n, max_size=n) for _ in range(3)),
        st.lists(st.tuples(any_float, any_float, any_float), min_size=n, max_size=n),
        st.lists(st.booleans(), min_size=n, max_size=n),
        st.floats(-3.0, 3.0),
        st.sampled_from(sorted(CONFIGS)),
    )
)


@settings(max_examples=60, deadline=None)
@given(masked_cases)
def test_masked_tokens_never_receive_gradient(case: tuple) -> None:
    lp, old, behav, garbage, mask_list, adv, name = case
    mask = torch.tensor(mask_list)
    values = [torch.tensor(v, dtype=torch.float64) for v in (lp, old, behav)]
    junk = torch.tensor(garbage, dtype=torch.float64)
    lp_t, old_t, behav_t = (torch.where(mask, v, junk[:, i]) for i, v in enumerate(values))
    lp_t.requires_grad_(True)
    num = max(int(mask.sum()), 1)
    cu = torch.tensor([0, len(mask_list)])
    loss, _ = packed_policy_loss(
        lp_t, old_t, behav_t, torch.tensor([adv], dtype=torch.float64), cu, mask, num, CONFIGS[name]
    )
    loss.backward()
    assert lp_t.grad is not None and torch.isfinite(loss)
    assert torch.isfinite(lp_t.grad).all()
    assert (lp_t.grad[~mask] == 0).all()


def test_global_token_denominator_and_diagnostics() -> None:
    lp = torch.tensor([0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    old = torch.zeros(4, dtype=torch.float64)
    behav = torch.tensor([0.0, -math.log(3), 0.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 0])
    loss, out = packed_policy_loss(
        lp, old, behav, torch.tensor([1.0, -4.0]), torch.tensor([0, 2, 4]), mask, 6, LossConfig()
    )
    # per-token: -1.28 (clipped), -2 (weight 3 -> 2, ratio 1, A = 1), 4 (A = -4, ratio 1); denominator 6
    torch.testing.assert_close(loss, torch.tensor((-1.28 - 2.0 + 4.0) / 6, dtype=torch.float64))
    assert out.is_weight.item() == pytest.approx((1.0 + 2.0 + 1.0) / 6)
    assert out.clip_fraction.item() == pytest.approx(1 / 6)
    assert out.is_capped_fraction.item() == pytest.approx(1 / 6)
    assert out.dual_clip_fraction.item() == 0.0
    assert out.max_abs_advantage.item() == 4.0
    assert out.approx_kl.item() == pytest.approx((math.exp(0.5) - 1.5) / 6)
    with pytest.raises(ValueError, match="num_global_action_tokens"):
        packed_policy_loss(
            lp, old, behav, torch.tensor([1.0, -4.0]), torch.tensor([0, 2, 4]), mask, 2, LossConfig()
        )


@pytest.mark.parametrize("name", sorted(ALL_CONFIGS))
def test_gradcheck_float64(name: str) -> None:
    gen = torch.Generator().manual_seed(11)
    old = torch.randn(24, generator=gen, dtype=torch.float64) * 0.5
    # log-ratios spread over every branch (inside the clip, clipped, dual-clipped), away from the kinks
    offsets = torch.tensor([-1.3, -0.6, -0.1, 0.05, 0.15, 0.7, 1.1, 1.6] * 3, dtype=torch.float64)
    logprobs = (old + offsets).requires_grad_(True)
    behaviour = old + torch.tensor([0.0, 0.3, -0.9, 1.2] * 6, dtype=torch.float64)
    cu = torch.tensor([0, 5, 11, 18, 24])
    adv = torch.tensor([1.5, -0.7, -2.0, 0.4], dtype=torch.float64)
    mask = torch.ones(24, dtype=torch.bool)
    mask[[2, 9, 20]] = False

    def f(lp: torch.Tensor) -> torch.Tensor:
        return packed_policy_loss(lp, old, behaviour, adv, cu, mask, 30, ALL_CONFIGS[name], 5)[0]

    assert torch.autograd.gradcheck(f, (logprobs,), eps=1e-6, atol=1e-8)


def test_loss_config_validation() -> None:
    with pytest.raises(ValueError):
        LossConfig(clip_low=1.0)
    with pytest.raises(ValueError):
        LossConfig(dual_clip_c=1.0)
    with pytest.raises(ValueError):
        LossConfig(is_cap=0.0)
    with pytest.raises(ValueError, match="decoupled"):
        LossConfig(decoupled=True, is_cap=None)


def test_loss_config_is_the_kernel_config() -> None:
    """One type from [algo] to the kernels: the algorithm's LossConfig is the kernels' KernelLossConfig."""
    assert LossConfig is KernelLossConfig
    with pytest.raises(ValueError, match="dual_clip_c"):
        KernelLossConfig(dual_clip_c=0.5)


def test_policy_loss_on_token_batch_equals_packed_policy_loss() -> None:
    """The entry point on per-token advantages equals the per-trajectory packed form; None old = current."""
    batch, cfg = _Batch([5, 0, 7, 4], seed=3), LossConfig()
    cu = torch.tensor([0, 5, 5, 12, 16])
    token_adv = broadcast_to_tokens(batch.advantages, cu)
    num_global = int(batch.mask.sum()) + 2
    lp = (-torch.nn.functional.softplus(batch.features @ batch.theta)).requires_grad_(True)
    inputs = LossInputs(batch.mask, batch.old, batch.behaviour, token_adv)
    loss, diag = policy_loss(lp, inputs, cfg, num_global, batch.old)
    ref_loss, ref = packed_policy_loss(
        lp, batch.old, batch.behaviour, batch.advantages, cu, batch.mask, num_global, cfg
    )
    assert isinstance(diag, LossDiagnostics) and loss.item() == ref_loss.item()
    for field in dataclasses.fields(LossDiagnostics):
        got, want = getattr(diag, field.name), getattr(ref, field.name)
        assert (got is None and want is None) or torch.equal(torch.as_tensor(got), torch.as_tensor(want))
    (grad,) = torch.autograd.grad(loss, lp)
    (ref_grad,) = torch.autograd.grad(ref_loss, lp)
    assert torch.equal(grad, ref_grad)
    assert set(diag.summed()) == {
        "approx_kl", "clip_fraction", "dual_clip_fraction", "is_capped_fraction", "is_rejected_fraction",
        "is_weight",
    }  # fmt: skip
    current, _ = policy_loss(lp, inputs, cfg, num_global)
    explicit, _ = policy_loss(lp, inputs, cfg, num_global, lp.detach())
    assert current.item() == explicit.item()
    with pytest.raises(ValueError, match="1-D of shape"):
        policy_loss(lp, LossInputs(batch.mask[:-1], batch.old, batch.behaviour, token_adv), cfg, num_global)
    with pytest.raises(ValueError, match="num_global_action_tokens"):
        policy_loss(lp, inputs, cfg, int(batch.mask.sum()) - 1)


def _two_trajectories(lp: list[float], behaviour: list[float] | None = None) -> dict:
    """Trajectory 0: a prompt token, then 3 action tokens (A = 1); trajectory 1: a prompt token, then 1
    action token (A = -2). Old log-probs 0; behaviour log-probs 0 unless given."""
    return {
        "logprobs": torch.tensor(lp, dtype=torch.float64, requires_grad=True),
        "old": torch.zeros(6, dtype=torch.float64),
        "behaviour": torch.tensor(behaviour or [0.0] * 6, dtype=torch.float64),
        "advantages": torch.tensor([1.0, -2.0], dtype=torch.float64),
        "cu_seqlens": torch.tensor([0, 4, 6]),
        "mask": torch.tensor([0, 1, 1, 1, 0, 1], dtype=torch.bool),
    }


def _loss(b: dict, cfg: LossConfig, num_tokens: int = 4, num_seqs: int = 2) -> tuple:
    args = (b["logprobs"], b["old"], b["behaviour"], b["advantages"], b["cu_seqlens"], b["mask"])
    return packed_policy_loss(*args, num_tokens, cfg, num_seqs)


@pytest.mark.parametrize(
    ("agg", "tokens", "expected", "grads"),
    [  # per-token losses at ratio 1: -1, -1, -1 (trajectory 0) and 2 (trajectory 1)
        ("token_mean", 0, (-3 + 2) / 4, [-1 / 4, -1 / 4, -1 / 4, 2 / 4]),
        ("seq_mean_token_mean", 0, (-3 / 3 + 2 / 1) / 2, [-1 / 6, -1 / 6, -1 / 6, 2 / 2]),
        ("seq_mean_token_sum_norm", 5, (-3 / 5 + 2 / 5) / 2, [-1 / 10, -1 / 10, -1 / 10, 2 / 10]),
    ],
)
def test_loss_aggregations_by_hand(agg: str, tokens: int, expected: float, grads: list[float]) -> None:
    """token-mean (/ N), seq-mean-token-mean (/ (B L_i)), Dr. GRPO's constant (/ (B C)), and their gradients;
    each trajectory alone, with the global counts, sums to the whole (micro-batches or ranks)."""
    cfg = LossConfig(loss_agg=agg, loss_agg_tokens=tokens)
    b = _two_trajectories([0.0] * 6)
    loss, diag = _loss(b, cfg)
    assert loss.item() == pytest.approx(expected)
    (grad,) = torch.autograd.grad(loss, b["logprobs"])
    assert grad[b["mask"]].tolist() == pytest.approx(grads)
    assert diag.is_weight.item() == pytest.approx(1.0)  # diagnostics stay global token means
    parts = 0.0
    for lo, hi, traj in ((0, 4, 0), (4, 6, 1)):
        part = {k: b[k][lo:hi] for k in ("logprobs", "old", "behaviour", "mask")}
        part |= {"advantages": b["advantages"][traj : traj + 1], "cu_seqlens": torch.tensor([0, hi - lo])}
        parts += _loss(part, cfg)[0].item()
    assert parts == pytest.approx(expected)
    if agg != "token_mean":  # a global trajectory count below this micro-batch's is a caller's bug
        with pytest.raises(ValueError, match="num_global_sequences"):
            _loss(b, cfg, num_seqs=1)


def test_gspo_sequence_ratio_by_hand() -> None:
    """GSPO: s_i = exp(mean log-ratio of trajectory i); -A_i min(s_i, clip(s_i)) per trajectory, averaged;
    d loss / d logp_t = -A_i s_i / (B |y_i|) inside the clip, 0 outside."""
    cfg = SEQ_CONFIGS["gspo"]
    # trajectory 0: log-ratios 1e-4, 2e-4, 3e-4 -> s = e^2e-4, inside [1 - 3e-4, 1 + 4e-4];
    # trajectory 1 (A < 0): log-ratio -1e-3 -> s = e^-1e-3 below 1 - 3e-4: clipped (pessimistic branch)
    b = _two_trajectories([0.0, 1e-4, 2e-4, 3e-4, 0.0, -1e-3])
    loss, diag = _loss(b, cfg)
    s0 = math.exp(2e-4)
    assert loss.item() == pytest.approx((-1.0 * s0 + 2.0 * (1 - 3e-4)) / 2, rel=1e-12)
    (grad,) = torch.autograd.grad(loss, b["logprobs"])
    assert grad[b["mask"]].tolist() == pytest.approx([-s0 / 6] * 3 + [0.0], rel=1e-12)
    assert diag.clip_fraction.item() == pytest.approx(1 / 4)


def test_sequence_level_weight_and_rejection_by_hand() -> None:
    """is_level 'sequence': exp(mean over the trajectory's action tokens of old - behaviour) on each of its
    tokens; rejection masks whole trajectories (sequence) or single tokens (token) outside the bounds."""
    # old - behaviour: trajectory 0: 0, log 4, log 4 / 2 -> mean log 2 ... weight 2 on its three tokens;
    # trajectory 1: log 0.25 -> weight 0.25, below is_reject_low = 0.5: rejected
    behaviour = [0.0, 0.0, -math.log(4), -math.log(4) / 2, 0.0, math.log(4)]
    lp = [0.0] * 6
    mean_log = (math.log(4) + math.log(4) / 2) / 3
    cfg = LossConfig(is_level="sequence", is_cap=None, is_reject_low=0.5, is_reject_high=3.0)
    terms = ppo_token_terms(
        *(_two_trajectories(lp, behaviour)[k] for k in ("logprobs", "old", "behaviour")),
        torch.tensor([0, 1, 1, 1, 0, -2.0], dtype=torch.float64),
        _two_trajectories(lp)["mask"],
        cfg,
        torch.tensor([0, 4, 6]),
    )
    assert terms.is_weight.tolist() == pytest.approx(
        [0, math.exp(mean_log)] * 1 + [math.exp(mean_log)] * 2 + [0, 0]
    )
    assert terms.is_rejected.tolist() == [0, 0, 0, 0, 0, 1]
    token = LossConfig(is_cap=None, is_reject_low=0.5, is_reject_high=3.0)
    b = _two_trajectories(lp, behaviour)
    tok = ppo_token_terms(b["logprobs"], b["old"], b["behaviour"], torch.ones(6), b["mask"], token)
    # token weights 1, 4 (> 3: rejected), 2, and 0.25 (< 0.5: rejected)
    assert tok.is_weight.tolist() == pytest.approx([0, 1, 0, 2, 0, 0])
    assert tok.is_rejected.tolist() == [0, 0, 1, 0, 0, 1]
    loss, diag = _loss(b, token)
    assert diag.is_rejected_fraction.item() == pytest.approx(2 / 4)


def test_sequence_settings_need_cu_seqlens() -> None:
    b = _two_trajectories([0.0] * 6)
    inputs = LossInputs(b["mask"], b["old"], b["behaviour"], torch.zeros(6, dtype=torch.float64))
    for cfg in SEQ_CONFIGS.values():
        if cfg.needs_sequences:
            with pytest.raises(ValueError, match="cu_seqlens"):
                policy_loss(b["logprobs"], inputs, cfg, 4, None, 2)


def test_loss_config_contradictions() -> None:
    with pytest.raises(ValueError, match="loss_agg_tokens"):
        LossConfig(loss_agg="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="loss_agg_tokens"):
        LossConfig(loss_agg_tokens=8)
    with pytest.raises(ValueError, match="set one"):
        LossConfig(decoupled=True, is_reject_high=3.0)
    with pytest.raises(ValueError, match="never acts"):
        LossConfig(is_cap=3.0, is_reject_high=2.0)
    with pytest.raises(ValueError, match="is_reject_low"):
        LossConfig(is_reject_low=1.5)
    with pytest.raises(ValueError, match="ratio_level"):
        LossConfig(ratio_level="trajectory")


def test_entropy_bonus_by_hand() -> None:
    """loss = sum_t w_t (loss_t - c H_t): token-mean weights 1/4 here; d loss / d H_t = -c w_t."""
    b = _two_trajectories([0.0] * 6)
    entropy = torch.tensor([9.0, 1.0, 2.0, 3.0, 9.0, 4.0], dtype=torch.float64, requires_grad=True)
    inputs = SequenceBatch(
        b["mask"], b["behaviour"], torch.tensor([0, 1, 1, 1, 0, -2.0], dtype=torch.float64), b["cu_seqlens"]
    )
    cfg = LossConfig(entropy_coef=0.1)
    loss, diag = policy_loss(b["logprobs"], inputs, cfg, 4, None, 2, entropy)
    assert loss.item() == pytest.approx((-3 + 2) / 4 - 0.1 * (1 + 2 + 3 + 4) / 4)
    assert diag.entropy.item() == pytest.approx(10 / 4)
    (grad,) = torch.autograd.grad(loss, entropy)
    assert grad.tolist() == pytest.approx([0, -0.025, -0.025, -0.025, 0, -0.025])
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(b["logprobs"], inputs, cfg, 4, None, 2)


def test_kl_estimators_and_the_kl_term_by_hand() -> None:
    """k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r with log r = ref - logp; kl_in 'loss' adds
    kl_coef x the estimate (aggregated as the loss); 'reward' subtracts kl_coef x the proximal policy's
    estimate summed from each token to its trajectory's end from that token's advantage."""
    lp = [0.0, -0.5, 0.0, 0.2, 0.0, 0.0]
    b = _two_trajectories(lp, lp)  # behaviour = proximal = current: every ratio and weight is 1
    ref = torch.tensor([0.0, -1.0, 0.0, 0.0, 0.0, -0.3], dtype=torch.float64)
    log_r = torch.tensor([0.0, -0.5, 0.0, -0.2, 0.0, -0.3], dtype=torch.float64)
    expected = {
        "k1": -log_r,
        "k2": 0.5 * log_r**2,
        "k3": torch.exp(log_r) - 1 - log_r,
    }
    for name, want in expected.items():
        torch.testing.assert_close(kl_estimate(b["logprobs"], ref, b["mask"], name), want)
    assert kl_estimate(ref, ref, b["mask"], "k3").abs().max() == 0  # the policy is the reference: KL = 0
    torch.testing.assert_close(
        reward_to_go(torch.arange(6.0), b["mask"], b["cu_seqlens"]),
        torch.tensor([6.0, 6.0, 5.0, 3.0, 5.0, 5.0]),
    )
    inputs = SequenceBatch(
        b["mask"], b["behaviour"], torch.tensor([0, 1, 1, 1, 0, -2.0], dtype=torch.float64), b["cu_seqlens"]
    )
    base, _ = policy_loss(b["logprobs"], inputs, LossConfig(), 4, None, None, None, ref)
    in_loss, diag = policy_loss(b["logprobs"], inputs, LossConfig(kl_coef=0.5), 4, None, None, None, ref)
    k3 = expected["k3"][b["mask"]]
    assert float((in_loss - base).detach()) == pytest.approx(0.5 * float(k3.sum()) / 4)
    assert float(diag.kl) == pytest.approx(float(k3.sum()) / 4)
    # 'reward': proximal = current here, so token t's advantage loses 0.5 x k3 summed to its trajectory's end
    cfg = LossConfig(kl_coef=0.5, kl_in="reward", dual_clip_c=None)
    in_reward, _ = policy_loss(b["logprobs"], inputs, cfg, 4, None, None, None, ref)
    k = expected["k3"]
    to_go = torch.tensor([k[1] + k[2] + k[3], k[2] + k[3], k[3], k[5]])
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0], dtype=torch.float64) - 0.5 * to_go
    assert float(in_reward.detach()) == pytest.approx(float(-adv.sum() / 4))
    with pytest.raises(ValueError, match="reference"):
        policy_loss(b["logprobs"], inputs, LossConfig(kl_coef=0.5), 4)
