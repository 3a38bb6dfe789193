"""The reward functions of the reward role, keyed by name, and the lookup of a function by name or path.

`REWARD_FNS` holds the built-in families' functions (from their registrations in
`rollart_hpc.tasks.registry`); `reward_fn(name)` returns one of them, or, for an import path
("package.module:function", e.g. a `reward.functions` entry), the function it names. The records a
function sees and returns live in `rollart_hpc.tasks.rewards` (re-exported here and in `rollart_hpc.api`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from rollart_hpc.tasks.plugins import load_callable
from rollart_hpc.tasks.registry import BUILTIN_FAMILIES
from rollart_hpc.tasks.rewards import RewardFn, RewardInput, RewardOutput, env_won

__all__ = ["REWARD_FNS", "RewardFn", "RewardInput", "RewardOutput", "env_won", "reward_fn"]

REWARD_FNS: dict[str, RewardFn] = {name: load_callable(e.reward) for name, e in BUILTIN_FAMILIES.items()}


def reward_fn(name: str, python_path: Iterable[str] = ()) -> RewardFn:
    """The function registered as `name`, or the one the import path `name` names."""
    if name in REWARD_FNS:
        return REWARD_FNS[name]
    if ":" in name:
        return _load(name, tuple(python_path))
    raise KeyError(f"no reward function {name!r}; known: {', '.join(sorted(REWARD_FNS))}")


@functools.cache
def _load(path: str, python_path: tuple[str, ...]) -> RewardFn:
    return load_callable(path, python_path)  # type: ignore[no-any-return]
