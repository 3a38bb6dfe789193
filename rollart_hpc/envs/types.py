"""Records and contracts shared by every environment family, the env workers and the agent loop.

Pure data, no heavy imports. A `Task` names one episode's starting point; an `Env` plays one episode at
a time (`reset(task_id)` then `step(action_text)` until done); a `Trajectory` is the flat, typed record of
one finished (or failed) episode that the pipeline stores in HDF5 and trains on.

Trajectory invariants (checked by `Trajectory.validate`):
- `token_ids`, `action_mask`, `logprobs` and `versions` have the same length;
- a token with mask 0 (system, template, observation, padding) has version -1 and log-prob 0.0;
- `llm_s`, `env_s` and `actions` have one entry per turn and `num_turns == len(actions)`;
- `status` is "ok" or "failed"; a failed trajectory has reward 0.0, success False and a failure cause.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Status = Literal["ok", "failed"]

# Why an episode ended. "ok" trajectories end with one of OK_CAUSES, failed ones with FAILURE_CAUSES.
OK_CAUSES = ("done", "max_turns", "context_limit", "max_tokens")
FAILURE_CAUSES = ("crash", "timeout", "error", "llm_error", "abort")

DispatchValue = int | float | str | bool


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


@dataclass
class Trajectory:
    """One episode as flat typed arrays plus scalars; see the module docstring for the invariants."""

    task_id: str
    family: str
    tags: tuple[str, ...]
    episode_id: str
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prompt_len: int = 0
    actions: list[str] = field(default_factory=list)
    llm_s: list[float] = field(default_factory=list)
    env_s: list[float] = field(default_factory=list)
    reset_s: float = 0.0
    num_turns: int = 0
    env_return: float = 0.0
    env_won: bool = False
    reward: float = 0.0
    success: bool = False
    status: Status = "ok"
    finish_cause: str = ""
    error: str = ""
    dispatch: dict[str, DispatchValue] = field(default_factory=dict)

    @property
    def failure_cause(self) -> str:
        """The failure cause of a failed trajectory, "" for an ok one."""
        return self.finish_cause if self.status == "failed" else ""

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    def append(self, ids: list[int], generated: bool, logprobs: list[float], versions: list[int]) -> None:
        """Append one segment; non-generated segments get version -1 and log-prob 0."""
        self.token_ids.extend(ids)
        self.action_mask.extend([1 if generated else 0] * len(ids))
        if generated:
            if len(logprobs) != len(ids) or len(versions) != len(ids):
                raise ValueError(
                    f"generated segment of {len(ids)} tokens has {len(logprobs)} logprobs, "
                    f"{len(versions)} versions"
                )
            self.logprobs.extend(float(x) for x in logprobs)
            self.versions.extend(int(v) for v in versions)
        else:
            self.logprobs.extend([0.0] * len(ids))
            self.versions.extend([-1] * len(ids))

    def validate(self) -> None:
        """Raise ValueError if an invariant of the module docstring does not hold."""
        n = len(self.token_ids)
        if not len(self.action_mask) == len(self.logprobs) == len(self.versions) == n:
            raise ValueError(f"trajectory {self.episode_id}: array lengths differ")
        for m, lp, v in zip(self.action_mask, self.logprobs, self.versions, strict=True):
            if m == 0 and (v != -1 or lp != 0.0):
                raise ValueError(f"trajectory {self.episode_id}: non-generated token with version {v}")
        if not len(self.llm_s) == len(self.env_s) == len(self.actions) == self.num_turns:
            raise ValueError(f"trajectory {self.episode_id}: per-turn lists disagree with num_turns")
        causes = OK_CAUSES if self.status == "ok" else FAILURE_CAUSES
        if self.finish_cause not in causes:
            raise ValueError(f"trajectory {self.episode_id}: cause {self.finish_cause!r} for {self.status}")
        if self.status == "failed" and (self.reward != 0.0 or self.success):
            raise ValueError(f"trajectory {self.episode_id}: failed trajectory carries a reward")

    def oldest_version(self) -> int:
        """The smallest policy version among generated tokens (-1 when none were generated)."""
        gen = [v for v, m in zip(self.versions, self.action_mask, strict=True) if m]
        return min(gen) if gen else -1
