"""The SPO++ algorithm library: value trackers, task sampler, advantage estimators, policy loss.

`tracker`, `sampler` and `advantages` need only numpy, so the controller imports them without torch.
The torch loss (`loss`) is loaded on first access of one of its names below (`LOSS_EXPORTS`), never at
package import.
"""

from __future__ import annotations

import importlib
from typing import Any

from rollart_hpc.algo.advantages import (
    ADVANTAGE_ALIASES,
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
from rollart_hpc.algo.sampler import TaskSampler, priority_weight
from rollart_hpc.algo.tracker import (
    TRACKERS,
    Dispatch,
    EventTimeTracker,
    SPORho,
    SPOTracker,
    ValueTracker,
    jeffreys_prior,
    offline_priors,
    response_drift,
)

LOSS_EXPORTS = (
    "SUMMED_DIAGNOSTICS",
    "LMHeadInputs",
    "LossBatch",
    "LossConfig",
    "LossDiagnostics",
    "SequenceBatch",
    "TokenTerms",
    "broadcast_to_tokens",
    "loss_config",
    "packed_policy_loss",
    "policy_loss",
    "ppo_token_terms",
)

__all__ = [
    "ADVANTAGE_ALIASES",
    "ADVANTAGE_ESTIMATORS",
    "TRACKERS",
    "AdvantageInputs",
    "Dispatch",
    "EventTimeTracker",
    "SPORho",
    "SPOTracker",
    "TaskSampler",
    "ValueTracker",
    "advantage_diagnostics",
    "batch_whitened_advantages",
    "dr_grpo_advantages",
    "get_advantage_estimator",
    "grpo_advantages",
    "jeffreys_prior",
    "offline_priors",
    "priority_weight",
    "response_drift",
    "rloo_advantages",
    "token_normalized_advantages",
    "trajectory_whitened_advantages",
    *LOSS_EXPORTS,
]


def __getattr__(name: str) -> Any:
    if name in LOSS_EXPORTS:
        return getattr(importlib.import_module("rollart_hpc.algo.loss"), name)
    raise AttributeError(f"module 'rollart_hpc.algo' has no attribute {name!r}")
