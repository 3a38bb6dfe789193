"""What a reward function sees and returns, and the reward of an env's own verdict.

A reward function is stateless: it sees only a `RewardInput` (what the trajectory says happened) and
returns a `RewardOutput`, so any number of calls may run at once in threads or processes. A rule-based
function is a plain callable; an LLM judge may be an `async` callable. The reward role keys them by
family (`rollart_hpc.reward.functions`); a family's own function is named by import path in its
registration (`rollart_hpc.tasks.registry`) or in the config (`reward.functions`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollart_hpc.contracts.records import Trajectory


@dataclass(frozen=True)
class RewardInput:
    """One finished episode as a reward function sees it: the task, the agent's replies in order, and
    what the env reported (its summed step rewards and whether it said `info["won"]`)."""

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
    """The trained reward and whether the episode counts as a success (success-rate metrics)."""

    reward: float
    success: bool


RewardFn = Callable[[RewardInput], RewardOutput] | Callable[[RewardInput], Awaitable[RewardOutput]]

ENV_WON = "rollart_hpc.tasks.rewards:env_won"
"""The import path of `env_won`, the reward of a family that names no function of its own."""


AGENT_RETURN = "rollart_hpc.tasks.rewards:agent_return"
"""The import path of `agent_return`, the reward of every family of a run with its own agent (`envs.agent`)."""


def agent_return(inp: RewardInput) -> RewardOutput:
    """The reward an agent of the run's own returned (`env_return`), a success when it said so (`env_won`)."""
    return RewardOutput(inp.env_return, inp.env_won)


def env_won(inp: RewardInput) -> RewardOutput:
    """1.0 if the env reported a win (household, frozenlake, and every family without its own function)."""
    return RewardOutput(1.0 if inp.env_won else 0.0, inp.env_won)
