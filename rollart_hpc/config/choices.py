"""The closed sets of names the config accepts, and the facts tied to them. Stdlib only.

Each fact has its one home here, below every role: the schema validates against these names, and the
roles that implement them (the controller's modes, the env families, the household quest types) import
them from here instead of restating them.
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["sync", "one_step_off", "async"]
MODES: tuple[Mode, ...] = ("sync", "one_step_off", "async")
"""Controller modes. 'sync': generate, train, sync; 'one_step_off': batch k+1 generated while training
k; 'async': generation never waits for training, within the staleness bound."""

MODE_STALENESS: dict[str, int] = {"sync": 0, "one_step_off": 1}
"""The staleness bound that a mode implies; a mode absent here ('async') takes any bound >= 0."""

ASYNC_DEFAULT_STALENESS = 1
"""The bound of 'async' when the config leaves `controller.max_staleness` at -1."""


def default_staleness(mode: str) -> int:
    """The staleness bound of `mode` when the config does not state one."""
    return MODE_STALENESS.get(mode, ASYNC_DEFAULT_STALENESS)


FamilyName = Literal["household", "calc_math", "frozenlake"]
FAMILY_NAMES: tuple[FamilyName, ...] = ("household", "calc_math", "frozenlake")
"""Environment families; `rollart_hpc.tasks.registry.FAMILIES` holds one constructor for each."""

HOUSEHOLD_TYPES = ("put_in", "put_on", "two_obj", "open_then_put", "other_room", "cook")
"""Household quest types; game `i` of the canonical set has type `HOUSEHOLD_TYPES[i % 6]`."""

CALC_MAX_OPS = 3
"""calc_math: problem `i` of the canonical set has `1 + i % CALC_MAX_OPS` operations."""

AlgoName = Literal["spo++", "spo", "grpo", "dr_grpo", "rloo", "reinforce++", "gspo", "custom"]
TrackerKind = Literal["", "event_time", "arrival"]
Normalization = Literal["", "action_token", "trajectory"]
Estimator = Literal["", "tracker", "group", "batch"]
GroupAdvantage = Literal["", "grpo", "dr_grpo", "rloo"]
LossAgg = Literal["", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
Level = Literal["", "token", "sequence"]

_GROUP_ARM: dict[str, str] = {"tracker": "event_time", "estimator": "group"}

ALGO_PRESETS: dict[str, dict[str, str]] = {
    "spo++": {"tracker": "event_time", "normalization": "action_token", "estimator": "tracker"},
    "spo": {"tracker": "arrival", "normalization": "trajectory", "estimator": "tracker"},
    "grpo": {**_GROUP_ARM, "group_advantage": "grpo"},
    "dr_grpo": {**_GROUP_ARM, "group_advantage": "dr_grpo", "loss_agg": "seq_mean_token_sum_norm"},
    "rloo": {**_GROUP_ARM, "group_advantage": "rloo"},
    "reinforce++": {"tracker": "event_time", "estimator": "batch", "loss_agg": "token_mean"},
    "gspo": {
        **_GROUP_ARM,
        "group_advantage": "grpo",
        "ratio_level": "sequence",
        "loss_agg": "seq_mean_token_mean",
    },
    "custom": {},
}
"""The algorithm arms: the `algo` fields each `algo.name` sets. 'custom' sets none; its unset fields take
`ALGO_DEFAULTS`. The group and batch arms keep a tracker: it drives the task sampler."""

ALGO_DEFAULTS: dict[str, str] = {
    "tracker": "event_time",
    "estimator": "tracker",
    "loss_agg": "token_mean",
    "ratio_level": "token",
}
"""What an `algo` field left unset ('') takes when `algo.name` does not set it."""

CLIP_DEFAULTS: dict[str, tuple[float, float]] = {"gspo": (3e-4, 4e-4)}
"""(clip_low, clip_high) of an arm when the config leaves them at 0 (GSPO clips the sequence ratio);
other arms take `DEFAULT_CLIP`. Unlike `ALGO_PRESETS`, the config may set other values."""

DEFAULT_CLIP = (0.2, 0.28)
"""(clip_low, clip_high) left at 0 by the config: DAPO's asymmetric clip."""

DEFAULT_GROUP_SIZE = 4
"""`algo.group_size` of the group estimator when the config leaves it at 0."""

LEGACY_ADVANTAGE: dict[str, Normalization] = {"spo++": "action_token", "spo": "trajectory"}
"""The old `algo.advantage` values and the `algo.normalization` each one means."""
