"""Records and contracts shared by every environment family, the env workers and the agent loop.

Pure data, no heavy imports. A `Task` names one episode's starting point; an `Env` plays one episode at
a time (`reset(task_id)` then `step(action_text)` until done). The record of a finished episode, the
`Trajectory`, crosses role boundaries and lives in `rollart_hpc.contracts.records`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Task:
    """One canonical task: a stable id, its family, routing tags, a turn limit and its prompt texts.

    `stop`: strings that end a generated turn (the family's tool-call closers); the tokens that complete
    one are kept, so the env sees the closed call and the trainer sees exactly what was sampled.
    """

    id: str
    family: str
    tags: tuple[str, ...]
    max_turns: int
    system: str
    prompt: str
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """What `Env.step` returns, as a record (also usable as the 4-tuple through `as_tuple`)."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any]

    def as_tuple(self) -> tuple[str, float, bool, dict[str, Any]]:
        return self.observation, self.reward, self.done, self.info


class Env(Protocol):
    """A synchronous multi-turn text environment; one episode at a time, any task of its family.

    `step` returns `info["won"]` (bool) on every step; after `done` the caller must reset before stepping.
    """

    def reset(self, task_id: str) -> str: ...

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]: ...

    def close(self) -> None: ...


class EnvError(Exception):
    """An env could not answer: `cause` is one of "crash", "timeout" or "error"."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause
        self.detail = detail


class AsyncEnv(Protocol):
    """What the agent loop drives: an env behind an awaitable boundary (a child process, or in-process)."""

    async def reset(self, task_id: str) -> str: ...

    async def step(self, action_text: str) -> StepResult: ...
