"""Trajectory-level advantage estimators: SPO++ token measure, SPO whitening, GRPO, Dr. GRPO, RLOO,
REINFORCE++.

Every function takes 1-D per-trajectory arrays (numpy arrays or torch tensors, one value per trajectory)
and returns the same type (and device), in the input's floating dtype (float64 for integer input); the
arithmetic runs in float64. torch is imported only when a tensor is passed in, so the controller
stays torch-free.

- `token_normalized_advantages` (SPO++ Eq. 6): centre and scale over the *action-token* measure,
  mu_tok = sum L_i A_i / sum L_i, sigma_tok^2 = sum L_i (A_i - mu_tok)^2 / (sum L_i - 1). Invariant:
  sum_i L_i A_tilde_i = 0, so a token-mean loss sees a zero-mean advantage.
- `trajectory_whitened_advantages` (SPO Eq. 4): (A - mean) / (std_{n-1} + 1e-8); its token-weighted mean
  is Cov_n(L, A_tilde) / L_bar (Eq. 5), which `advantage_diagnostics` reports.
- `grpo_advantages`: (R - mean_G) / (std_G + 1e-6) within each group (unbiased std; a group of one gets
  mean 0 and std 1, as verl does). `dr_grpo_advantages`: R - mean_G (Dr. GRPO drops the std; its other
  half, the constant denominator batch size x max response length, is the loss's aggregation
  `seq_mean_token_sum_norm`, see `rollart_hpc.kernels.token_loss.aggregation_weights`).
- `rloo_advantages` (RLOO): R_i - mean_{j != i} R_j = G / (G - 1) (R_i - mean_G) within each group of G.
- `batch_whitened_advantages` (REINFORCE++): (R - mean) / (unbiased std + 1e-8) over the batch's
  trajectories: no critic, no group (`trajectory_whitened_advantages` of the rewards).

`ADVANTAGE_ESTIMATORS` maps config names to estimators over `AdvantageInputs`:
"token" (SPO++; alias "spo++"), "trajectory" (SPO; alias "spo"), "grpo", "dr_grpo", "rloo",
"reinforce++". SPO and SPO++ use the frozen dispatch baselines, A_i = R_i - v_hat_i; group variants use
group ids; REINFORCE++ reads the rewards only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from rollart_hpc.contracts.errors import UsageError

TRAJECTORY_EPS = 1e-8
GRPO_EPS = 1e-6

ArrayT = TypeVar("ArrayT")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _float64(x: Any, like: Any) -> Any:
    """x as a float64 array of `like`'s library (and device, for torch)."""
    if _is_torch(like):
        import torch  # already loaded: the caller passed a tensor

        return torch.as_tensor(x, dtype=torch.float64, device=like.device).detach()
    if _is_torch(x):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _restore(result: Any, like: Any) -> Any:
    """Cast a float64 result back to `like`'s floating dtype (integer input stays float64)."""
    if _is_torch(like):
        return result.to(like.dtype) if like.is_floating_point() else result
    like = np.asarray(like)
    return result.astype(like.dtype) if np.issubdtype(like.dtype, np.floating) else result


def _check_1d(name: str, x: Any) -> None:
    if len(x.shape) != 1:
        raise ValueError(f"{name} must be 1-D (one value per trajectory), got shape {tuple(x.shape)}")


def token_normalized_advantages(advantages: ArrayT, action_token_counts: Any) -> ArrayT:
    """SPO++ Eq. 6: whiten trajectory advantages over the action-token measure (weights L_i)."""
    a = _float64(advantages, advantages)
    lengths = _float64(action_token_counts, advantages)
    _check_1d("advantages", a)
    if lengths.shape != a.shape:
        raise ValueError(f"action_token_counts shape {tuple(lengths.shape)} != advantages {tuple(a.shape)}")
    if bool((lengths < 0).any()):
        raise ValueError("action_token_counts must be >= 0")
    total = float(lengths.sum())
    if total <= 0:
        raise ValueError("token normalisation needs at least one action token in the batch")
    mu = (lengths * a).sum() / total
    var = (lengths * (a - mu) ** 2).sum() / (total - 1) if total > 1 else 0.0
    return _restore((a - mu) / (var**0.5 + TRAJECTORY_EPS), advantages)  # type: ignore[no-any-return]


def trajectory_whitened_advantages(advantages: ArrayT) -> ArrayT:
    """SPO Eq. 4: (A - mean) / (unbiased std + 1e-8) over trajectories; one trajectory gives 0."""
    a = _float64(advantages, advantages)
    _check_1d("advantages", a)
    n = a.shape[0]
    if n == 0:
        raise ValueError("trajectory whitening needs at least one trajectory")
    mu = a.sum() / n
    var = ((a - mu) ** 2).sum() / (n - 1) if n > 1 else 0.0
    return _restore((a - mu) / (var**0.5 + TRAJECTORY_EPS), advantages)  # type: ignore[no-any-return]


def _group_index(group_ids: Sequence[Hashable]) -> np.ndarray:
    first_seen: dict[Hashable, int] = {}
    return np.array([first_seen.setdefault(g, len(first_seen)) for g in group_ids], dtype=np.int64)


def _group_centred(
    rewards: Any, group_ids: Sequence[Hashable], scale_by_std: bool, leave_one_out: bool = False
) -> Any:
    r = _float64(rewards, rewards)
    _check_1d("rewards", r)
    if len(group_ids) != r.shape[0]:
        raise ValueError(f"{len(group_ids)} group ids for {r.shape[0]} rewards")
    r_np = _float64(r, np.zeros(0))
    index = _group_index(group_ids)
    out = np.empty_like(r_np)
    for g in range(int(index.max()) + 1 if len(index) else 0):
        members = r_np[index == g]
        mean, std = (members.mean(), members.std(ddof=1)) if len(members) > 1 else (0.0, 1.0)
        centred = members - mean
        if leave_one_out and len(members) > 1:  # R_i - mean of the others = G / (G - 1) (R_i - mean_G)
            centred = centred * len(members) / (len(members) - 1)
        out[index == g] = centred / (std + GRPO_EPS) if scale_by_std else centred
    return _restore(_float64(out, rewards), rewards)


def grpo_advantages(rewards: ArrayT, group_ids: Sequence[Hashable]) -> ArrayT:
    """GRPO: (R - mean_G) / (std_G + 1e-6) within each group of responses to one prompt."""
    return _group_centred(rewards, group_ids, scale_by_std=True)  # type: ignore[no-any-return]


def dr_grpo_advantages(rewards: ArrayT, group_ids: Sequence[Hashable]) -> ArrayT:
    """Dr. GRPO: R - mean_G within each group (no std scaling)."""
    return _group_centred(rewards, group_ids, scale_by_std=False)  # type: ignore[no-any-return]


def rloo_advantages(rewards: ArrayT, group_ids: Sequence[Hashable]) -> ArrayT:
    """RLOO: R_i - mean_{j != i} R_j within each group (a group of one keeps R_i)."""
    return _group_centred(rewards, group_ids, scale_by_std=False, leave_one_out=True)  # type: ignore[no-any-return]


def batch_whitened_advantages(rewards: ArrayT) -> ArrayT:
    """REINFORCE++: (R - batch mean) / (unbiased batch std + 1e-8) over the batch's trajectories."""
    return trajectory_whitened_advantages(rewards)


@dataclass(frozen=True)
class AdvantageInputs:
    """One optimizer step's trajectories: outcome, frozen baseline, action-token count, group id."""

    rewards: np.ndarray
    action_token_counts: np.ndarray
    baselines: np.ndarray | None = None
    group_ids: Sequence[Hashable] | None = None

    def raw_advantages(self) -> np.ndarray:
        if self.baselines is None:
            raise ValueError("SPO-style advantages need the frozen dispatch baselines")
        return np.asarray(self.rewards, dtype=np.float64) - np.asarray(self.baselines, dtype=np.float64)

    def groups(self) -> Sequence[Hashable]:
        if self.group_ids is None:
            raise ValueError("GRPO-style advantages need group ids")
        return self.group_ids


AdvantageEstimator = Callable[[AdvantageInputs], np.ndarray]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "token": lambda b: token_normalized_advantages(b.raw_advantages(), b.action_token_counts),
    "trajectory": lambda b: trajectory_whitened_advantages(b.raw_advantages()),
    "grpo": lambda b: grpo_advantages(np.asarray(b.rewards, dtype=np.float64), b.groups()),
    "dr_grpo": lambda b: dr_grpo_advantages(np.asarray(b.rewards, dtype=np.float64), b.groups()),
    "rloo": lambda b: rloo_advantages(np.asarray(b.rewards, dtype=np.float64), b.groups()),
    "reinforce++": lambda b: batch_whitened_advantages(np.asarray(b.rewards, dtype=np.float64)),
}
ADVANTAGE_ALIASES: dict[str, str] = {"spo++": "token", "spo": "trajectory"}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under `name` (or its alias)."""
    key = ADVANTAGE_ALIASES.get(name, name)
    if key not in ADVANTAGE_ESTIMATORS:
        known = sorted([*ADVANTAGE_ESTIMATORS, *ADVANTAGE_ALIASES])
        raise UsageError(f"unknown advantage estimator {name!r}; known: {', '.join(known)}")
    return ADVANTAGE_ESTIMATORS[key]


def advantage_diagnostics(
    raw_advantages: np.ndarray, action_token_counts: np.ndarray, normalized: np.ndarray
) -> dict[str, float]:
    """Batch diagnostics of SPO++ §2.3 (numpy in, floats out).

    mu_traj / mu_tok: trajectory- and token-weighted means of the raw advantages; cov_over_lbar:
    Cov_n(L, A_traj) / L_bar, the mean a token-mean loss would see under trajectory whitening (Eq. 5);
    token_mean: the token-weighted mean of `normalized`; max_abs: max |normalized|.
    """
    a = np.asarray(raw_advantages, dtype=np.float64)
    lengths = np.asarray(action_token_counts, dtype=np.float64)
    norm = np.asarray(normalized, dtype=np.float64)
    whitened = trajectory_whitened_advantages(a)
    l_bar = lengths.mean()
    cov_n = ((lengths - l_bar) * (whitened - whitened.mean())).mean()
    return {
        "mu_traj": float(a.mean()),
        "mu_tok": float((lengths * a).sum() / lengths.sum()),
        "cov_over_lbar": float(cov_n / l_bar),
        "token_mean": float((lengths * norm).sum() / lengths.sum()),
        "max_abs": float(np.abs(norm).max()),
    }
