"""From one step's trajectories to the trainer ranks' shards: advantages, per-token arrays, DP split.

Advantages are computed over the whole optimizer step's batch (SPO++ Eq. 6 normalises over the batch's
action tokens; the group estimator centres each group of the batch, GRPO / Dr. GRPO), then split whole sequences across data-parallel ranks, balanced by tokens. Every shard
carries the global action-token count of the step, the loss denominator on every rank. Torch-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollart_hpc.algo.advantages import (
    AdvantageInputs,
    advantage_diagnostics,
    dr_grpo_advantages,
    get_advantage_estimator,
)
from rollart_hpc.config.learning import AlgoConfig
from rollart_hpc.contracts.records import TrainShard
from rollart_hpc.controller.core import Batch

ESTIMATOR_OF_NORMALIZATION = {"action_token": "token", "trajectory": "trajectory"}


def estimator_name(algo: AlgoConfig) -> str:
    """The `ADVANTAGE_ESTIMATORS` key of the configured arm: the group advantage of the group estimator,
    else the normalisation of R - the frozen baseline."""
    if algo.estimator == "group":
        return algo.group_advantage
    if algo.estimator == "batch":
        return "reinforce++"
    return ESTIMATOR_OF_NORMALIZATION[algo.normalization]


def batch_advantages(batch: Batch, algo: AlgoConfig) -> tuple[np.ndarray, dict[str, float]]:
    """Per-trajectory advantages of a step's batch under `algo`, and their diagnostics. The group estimator
    groups by the tickets' `group_id`; its diagnostics read R - group mean (the batch estimator's R - batch
    mean) as the raw advantage."""
    trajs = [r.trajectory for r in batch.results]
    group_ids = [r.ticket.group_id for r in batch.results]
    inputs = AdvantageInputs(
        rewards=np.array([t.reward for t in trajs], dtype=np.float64),
        action_token_counts=np.array([t.num_action_tokens for t in trajs], dtype=np.float64),
        baselines=np.array([r.ticket.baseline for r in batch.results], dtype=np.float64),
        group_ids=group_ids if algo.estimator == "group" else None,
    )
    if algo.estimator == "group" and not all(group_ids):
        raise ValueError(f"step {batch.step}: the group estimator got episodes without a group id")
    normalized = np.asarray(get_advantage_estimator(estimator_name(algo))(inputs), dtype=np.float64)
    if algo.estimator == "group":
        raw = dr_grpo_advantages(inputs.rewards, group_ids)
    elif algo.estimator == "batch":
        raw = inputs.rewards - inputs.rewards.mean()
    else:
        raw = inputs.raw_advantages()
    diagnostics = advantage_diagnostics(raw, inputs.action_token_counts, normalized)
    return normalized, diagnostics


def balanced_assignment(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Longest first onto the least-loaded rank; deterministic; each rank's indices in batch order."""
    loads = [0] * num_ranks
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        parts[rank].append(index)
        loads[rank] += lengths[index]
    return [sorted(p) for p in parts]


def shard_batch(batch: Batch, advantages: np.ndarray, num_ranks: int) -> list[TrainShard]:
    trajs = [r.trajectory for r in batch.results]
    total_action = int(sum(t.num_action_tokens for t in trajs))
    shards = [TrainShard(batch.step, total_action) for _ in range(num_ranks)]
    for rank, indices in enumerate(balanced_assignment([len(t.token_ids) for t in trajs], num_ranks)):
        shard = shards[rank]
        for i in indices:
            t, adv = trajs[i], float(advantages[i])
            shard.tokens.append(list(t.token_ids))
            shard.action_masks.append(list(t.action_mask))
            shard.behaviour_logprobs.append(list(t.logprobs))
            shard.advantages.append([adv if m else 0.0 for m in t.action_mask])
            shard.seq_ids.append(t.episode_id)
    return shards


def batch_stats(batch: Batch) -> dict[str, Any]:
    """Success per family and staleness of a step's batch (for metrics.jsonl)."""
    trajs = [r.trajectory for r in batch.results]
    row: dict[str, Any] = {
        "trained_trajectories": len(trajs),
        "train_success": float(np.mean([t.success for t in trajs])),
        "train_reward": float(np.mean([t.reward for t in trajs])),
        "mean_staleness": float(np.mean([batch.step - r.ticket.version for r in batch.results])),
        "max_token_staleness": max(batch.step - t.oldest_version() for t in trajs),
        "action_tokens": int(sum(t.num_action_tokens for t in trajs)),
        "tokens": int(sum(len(t.token_ids) for t in trajs)),
    }
    for family in sorted({t.family for t in trajs}):
        wins = [t.success for t in trajs if t.family == family]
        row[f"train_success/{family}"] = float(np.mean(wins))
    return row
