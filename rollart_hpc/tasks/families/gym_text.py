"""Text Gymnasium environments as a family: observations and actions are strings.

`GymTextFamily(name, env, ...)` (named in a config as `factory = "rollart_hpc.api:gymnasium_family"`,
its arguments as `options`) plays the `gymnasium.Env` that the import path `env` names (a class, or any
callable returning one, called with `env_kwargs`). Task `<name>/<seed>` is the episode that
`env.reset(seed=seed)` starts: seeds `0 .. num_tasks-1` train, the next `num_heldout` are held out. A
reply is passed to `env.step` as the action text; the episode is done when the env terminates or
truncates, and it is won where the env says `info["won"]`, else where it terminated with a positive
reward. `oracle` names `solve(seed) -> list[str]`, the replies that win that episode (the warm start and
the tiny model's tokenizer learn from them). Gymnasium is imported when an env is made.
"""

from __future__ import annotations

import functools
from typing import Any

from rollart_hpc.tasks.plugins import load_callable
from rollart_hpc.tasks.types import Task


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} is a {type(value).__name__}, not a str (a text env is needed)")
    return value


class GymTextEnv:
    """One gymnasium env, reset to the seed of each task."""

    def __init__(self, family: GymTextFamily) -> None:
        import gymnasium

        self.family = family
        self.env = family.make_gym_env()
        if not isinstance(self.env, gymnasium.Env):
            raise TypeError(f"{family.env_path!r} made a {type(self.env).__name__}, not a gymnasium.Env")

    def reset(self, task_id: str) -> str:
        observation, _ = self.env.reset(seed=self.family.seed_of(task_id))
        return _text(observation, f"{self.family.env_path} reset observation")

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        observation, reward, terminated, truncated, info = self.env.step(action_text)
        won = bool(info.get("won", terminated and reward > 0))
        text = _text(observation, f"{self.family.env_path} step observation")
        return text, float(reward), bool(terminated or truncated), {**info, "won": won}

    def close(self) -> None:
        self.env.close()


class GymTextFamily:
    """The episodes of a text gymnasium env, one task per seed (see the module docstring)."""

    def __init__(
        self,
        name: str,
        env: str,
        oracle: str,
        env_kwargs: dict[str, Any] | None = None,
        num_tasks: int = 16,
        num_heldout: int = 0,
        max_turns: int = 8,
        system: str = "",
        stop: list[str] | tuple[str, ...] = (),
    ) -> None:
        if num_tasks < 1 or num_heldout < 0 or max_turns < 1:
            raise ValueError("num_tasks >= 1, num_heldout >= 0 and max_turns >= 1 required")
        self.name, self.env_path, self.oracle_path = name, env, oracle
        self.env_kwargs = dict(env_kwargs or {})
        self.num_tasks, self.num_heldout, self.max_turns = num_tasks, num_heldout, max_turns
        self.system, self.stop = system, tuple(stop)
        self._make = load_callable(env)
        self._solve = load_callable(oracle)

    def make_gym_env(self) -> Any:
        return self._make(**self.env_kwargs)

    def seed_of(self, tid: str) -> int:
        prefix, _, number = tid.partition("/")
        if prefix != self.name or not number.isdigit() or int(number) >= self.num_tasks + self.num_heldout:
            raise KeyError(f"unknown {self.name} task id {tid!r}")
        return int(number)

    def tasks(self) -> list[Task]:
        return [self.task(f"{self.name}/{seed}") for seed in range(self.num_tasks)]

    def heldout_tasks(self, count: int) -> list[Task]:
        seeds = range(self.num_tasks, self.num_tasks + min(count, self.num_heldout))
        return [self.task(f"{self.name}/{seed}") for seed in seeds]

    def task(self, tid: str) -> Task:
        prompt = self._first_observation(self.seed_of(tid))
        return Task(tid, self.name, (self.name,), self.max_turns, self.system, prompt, self.stop)

    @functools.cache  # noqa: B019 (one family object lives as long as its process)
    def _first_observation(self, seed: int) -> str:
        env = self.make_env()
        try:
            return env.reset(f"{self.name}/{seed}")
        finally:
            env.close()

    def make_env(self) -> GymTextEnv:
        return GymTextEnv(self)

    def oracle(self, tid: str) -> list[str]:
        return [str(reply) for reply in self._solve(self.seed_of(tid))]


def gymnasium_family(**options: Any) -> GymTextFamily:
    """The factory of text gymnasium families: `options` are `GymTextFamily`'s arguments."""
    return GymTextFamily(**options)
