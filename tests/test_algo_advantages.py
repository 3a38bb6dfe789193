"""Advantage estimators: SPO++ worked example, Eq. 5 and Eq. 6 properties, GRPO by hand, registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rollart_hpc.algo import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    advantage_diagnostics,
    batch_whitened_advantages,
    dr_grpo_advantages,
    get_advantage_estimator,
    grpo_advantages,
    rloo_advantages,
    token_normalized_advantages,
    trajectory_whitened_advantages,
)
from rollart_hpc.contracts.errors import UsageError

EXAMPLE_A = np.array([0.5, 0.5, -0.5, -0.5])  # v_hat = 0.5: two successes, two failures
EXAMPLE_L = np.array([200, 200, 2000, 2000])


def test_worked_example_trajectory_whitening() -> None:
    whitened = trajectory_whitened_advantages(EXAMPLE_A)
    np.testing.assert_allclose(whitened, [0.866, 0.866, -0.866, -0.866], atol=5e-4)
    token_mean = (EXAMPLE_L * whitened).sum() / EXAMPLE_L.sum()
    assert token_mean == pytest.approx(-0.709, abs=5e-4)


def test_worked_example_token_normalisation() -> None:
    normalized = token_normalized_advantages(EXAMPLE_A, EXAMPLE_L)
    np.testing.assert_allclose(normalized, [3.16, 3.16, -0.32, -0.32], atol=5e-3)
    assert (EXAMPLE_L * normalized).sum() == pytest.approx(0.0, abs=1e-9)
    diag = advantage_diagnostics(EXAMPLE_A, EXAMPLE_L, normalized)
    assert diag["mu_tok"] == pytest.approx(-0.409, abs=5e-4)
    assert diag["mu_traj"] == 0.0
    assert diag["cov_over_lbar"] == pytest.approx(-0.709, abs=5e-4)
    assert diag["token_mean"] == pytest.approx(0.0, abs=1e-12)
    assert diag["max_abs"] == pytest.approx(3.162, abs=1e-3)


batches = st.integers(2, 24).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=n, max_size=n),
        st.lists(st.integers(0, 3000), min_size=n, max_size=n),
    )
)


@settings(max_examples=80, deadline=None)
@given(batches)
def test_token_normalised_advantages_have_zero_action_token_mean(batch: tuple[list, list]) -> None:
    a, lengths = np.array(batch[0]), np.array(batch[1])
    assume(lengths.sum() >= 2)
    normalized = token_normalized_advantages(a, lengths)
    mu = (lengths * a).sum() / lengths.sum()
    sigma = np.sqrt((lengths * (a - mu) ** 2).sum() / (lengths.sum() - 1))
    # Rounding in a - mu is amplified by 1 / (sigma + eps): the bound scales with it.
    scale = lengths.sum() * (np.abs(a).max() + abs(mu)) / (sigma + 1e-8) + 1.0
    assert abs((lengths * normalized).sum()) <= 1e-9 * scale
    assume(sigma > 1e-4)
    weighted_var = (lengths * normalized**2).sum() / (lengths.sum() - 1)
    assert weighted_var == pytest.approx((sigma / (sigma + 1e-8)) ** 2, rel=1e-9)


@settings(max_examples=80, deadline=None)
@given(batches)
def test_eq5_token_mean_of_whitened_advantages_is_cov_over_mean_length(batch: tuple[list, list]) -> None:
    a, lengths = np.array(batch[0]), np.array(batch[1])
    assume(lengths.sum() >= 1)
    whitened = trajectory_whitened_advantages(a)
    lhs = (lengths * whitened).sum() / lengths.sum()
    l_bar = lengths.mean()
    rhs = np.mean((lengths - l_bar) * (whitened - whitened.mean())) / l_bar
    assert lhs == pytest.approx(rhs, abs=1e-9)
    assert advantage_diagnostics(a, lengths, whitened)["cov_over_lbar"] == pytest.approx(lhs, abs=1e-9)


def test_torch_and_numpy_inputs_return_their_own_type_and_dtype() -> None:
    a32 = torch.tensor(EXAMPLE_A, dtype=torch.float32)
    out = token_normalized_advantages(a32, torch.tensor(EXAMPLE_L))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), token_normalized_advantages(EXAMPLE_A, EXAMPLE_L), rtol=1e-6)
    out_traj = trajectory_whitened_advantages(a32.double())
    assert isinstance(out_traj, torch.Tensor) and out_traj.dtype == torch.float64
    np_out = trajectory_whitened_advantages(EXAMPLE_A.astype(np.float32))
    assert isinstance(np_out, np.ndarray) and np_out.dtype == np.float32
    assert trajectory_whitened_advantages(np.array([1, 0])).dtype == np.float64


def test_degenerate_batches() -> None:
    assert trajectory_whitened_advantages(np.array([0.3])).tolist() == [0.0]
    with pytest.raises(ValueError):
        trajectory_whitened_advantages(np.array([]))
    with pytest.raises(ValueError, match="action token"):
        token_normalized_advantages(np.array([0.5, -0.5]), np.array([0, 0]))
    with pytest.raises(ValueError, match=">= 0"):
        token_normalized_advantages(np.array([0.5, -0.5]), np.array([3, -1]))
    with pytest.raises(ValueError, match="1-D"):
        trajectory_whitened_advantages(np.zeros((2, 2)))


def test_grpo_matches_definition_on_hand_groups() -> None:
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    groups = ["p", "q", "p", "p", "q", "p", "s"]  # p: 1,0,1,1  q: 0,0  s: 1 (alone)
    # p: mean 0.75, unbiased std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5
    expected = [0.25 / 0.500001, 0.0, -0.75 / 0.500001, 0.25 / 0.500001, 0.0, 0.25 / 0.500001, 1 / 1.000001]
    np.testing.assert_allclose(grpo_advantages(rewards, groups), expected, rtol=1e-12)
    expected_dr = [0.25, 0.0, -0.75, 0.25, 0.0, 0.25, 1.0]
    np.testing.assert_allclose(dr_grpo_advantages(rewards, groups), expected_dr, rtol=1e-12)
    out = grpo_advantages(torch.tensor(rewards, dtype=torch.float32), groups)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    with pytest.raises(ValueError, match="group ids"):
        grpo_advantages(rewards, groups[:3])


def test_registry_names_aliases_and_inputs() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {"token", "trajectory", "grpo", "dr_grpo", "rloo", "reinforce++"}
    batch = AdvantageInputs(
        rewards=np.array([1.0, 1.0, 0.0, 0.0]),
        action_token_counts=EXAMPLE_L,
        baselines=np.full(4, 0.5),
        group_ids=["g", "g", "g", "h"],
    )
    np.testing.assert_allclose(
        get_advantage_estimator("spo++")(batch), token_normalized_advantages(EXAMPLE_A, EXAMPLE_L)
    )
    np.testing.assert_allclose(
        get_advantage_estimator("spo")(batch), trajectory_whitened_advantages(EXAMPLE_A)
    )
    np.testing.assert_allclose(get_advantage_estimator("dr_grpo")(batch), [1 / 3, 1 / 3, -2 / 3, 0.0])
    assert get_advantage_estimator("token") is ADVANTAGE_ESTIMATORS["token"]
    with pytest.raises(UsageError, match="dr_grpo"):
        get_advantage_estimator("ppo")
    no_baselines = AdvantageInputs(rewards=batch.rewards, action_token_counts=EXAMPLE_L)
    with pytest.raises(ValueError, match="baselines"):
        get_advantage_estimator("token")(no_baselines)
    with pytest.raises(ValueError, match="group ids"):
        get_advantage_estimator("grpo")(no_baselines)


def test_rloo_and_reinforce_plus_plus_by_hand() -> None:
    """RLOO: R_i - mean of the others in the group; REINFORCE++: (R - batch mean) / batch std (n - 1)."""
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 0.5])
    groups = ["a", "a", "a", "b", "b", "b"]
    # group a: 1 - 0 = 1, 0 - 0.5 = -0.5 (twice); group b: 1 - 1.25, 2 - 0.75, 0.5 - 1.5
    expected = [1.0, -0.5, -0.5, -0.25, 1.25, -1.0]
    np.testing.assert_allclose(rloo_advantages(rewards, groups), expected)
    np.testing.assert_allclose(
        get_advantage_estimator("rloo")(AdvantageInputs(rewards, rewards, None, groups)), expected
    )
    r = np.array([1.0, 0.0, 0.0, 3.0])  # mean 1, unbiased std sqrt((0 + 1 + 1 + 4) / 3) = sqrt(2)
    np.testing.assert_allclose(batch_whitened_advantages(r), (r - 1.0) / (math.sqrt(2) + 1e-8))
    got = get_advantage_estimator("reinforce++")(AdvantageInputs(r, np.ones(4), baselines=np.full(4, 0.7)))
    np.testing.assert_allclose(got, (r - 1.0) / (math.sqrt(2) + 1e-8))  # the baselines play no part
