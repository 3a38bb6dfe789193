"""Stateless reward functions, one per env family, in a registry keyed by name.

A reward function sees only a `RewardInput` (what the trajectory says happened) and returns a
`RewardOutput`; it keeps no state, so any number of them may run concurrently in threads or processes.
Rule-based functions are plain callables; an LLM judge can be registered as an `async` callable, which
the pool awaits instead of sending to its executor.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollart_hpc.contracts.records import Trajectory


@dataclass(frozen=True)
class RewardInput:
    task_id: str
    family: str
    actions: tuple[str, ...]
    env_return: float
    env_won: bool

    @classmethod
    def of(cls, traj: Trajectory) -> RewardInput:
        return cls(traj.task_id, traj.family, tuple(traj.actions), traj.env_return, traj.env_won)


@dataclass(frozen=True)
class RewardOutput:
    reward: float
    success: bool


RewardFn = Callable[[RewardInput], RewardOutput] | Callable[[RewardInput], Awaitable[RewardOutput]]


def env_won(inp: RewardInput) -> RewardOutput:
    """1.0 if the env reported a win (household, frozenlake)."""
    return RewardOutput(1.0 if inp.env_won else 0.0, inp.env_won)


def calc_math_answer(inp: RewardInput) -> RewardOutput:
    """1.0 if the final reply holds `<answer>` equal to the gold answer, recomputed from the task id."""
    from rollart_hpc.tasks.families.calc_math import (
        answer_matches,
        generate_problem,
        parse_action,
        parse_task_id,
    )

    if not inp.actions:
        return RewardOutput(0.0, False)
    kind, body = parse_action(inp.actions[-1])
    gold = generate_problem(parse_task_id(inp.task_id)).answer
    ok = kind == "answer" and answer_matches(body, gold)
    return RewardOutput(1.0 if ok else 0.0, ok)


REWARD_FNS: dict[str, RewardFn] = {
    "household": env_won,
    "frozenlake": env_won,
    "calc_math": calc_math_answer,
}


def reward_fn(name: str) -> RewardFn:
    if name not in REWARD_FNS:
        raise KeyError(f"no reward function {name!r}; known: {', '.join(sorted(REWARD_FNS))}")
    return REWARD_FNS[name]
