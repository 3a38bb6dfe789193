"""The plug-in surface: what a run's own environment families, task sets and reward functions implement.

A run names its own code by import path ("package.module:attribute"); `run.python_path` lists the
directories (relative to the config file) that every rank and its env and reward workers import it from.

Families (`[[envs.plugins]]`, and their names in `envs.families`)::

    [[envs.plugins]]
    name = "wordle"                           # the prefix of every task id: "wordle/..."
    factory = "wordle_game:make_family"       # factory(**options) -> Family
    options = { num_words = 12 }

The factory returns a `Family`: `name`; `tasks()` the training tasks (a non-empty list of `Task`, each of
this family, id "name/rest"); `heldout_tasks(n)` up to `n` evaluation tasks never among `tasks()`;
`task(id)` either kind by id; `make_env()` a fresh `Env`; `oracle(id)` the replies that win task `id`
(used for the warm start and the tiny model's tokenizer). Families are rebuilt from their spec in every
process (env workers play each episode in a child process), so the factory must be deterministic.

An `Env` plays one episode at a time: `reset(task_id) -> observation`, then `step(reply)` ->
`(observation, reward, done, info)` until `done`, with `info["won"]` (bool) on every step; `close()`.
An exception from an env ends that episode as failed (cause "error"), never the run.

Reward functions (`[reward] functions = { wordle = "wordle_game:score" }`) follow `RewardFunction`:
`fn(RewardInput) -> RewardOutput`, stateless (called in worker processes, possibly at once), or an
`async` function. A family without one is rewarded by its env's verdict (`env_won`).

The agent that plays each episode follows `Agent` (the built-in `run_episode`); an env is driven through
`AsyncEnv` (a child process per env slot) and turns are generated through `LLMClient`.

An agent of the run's own, written against the OpenAI chat-completions API, follows `OpenAIAgent`::

    [envs]
    agent = "my_agent:run"                    # async def run(client: openai.AsyncOpenAI, task: Task)

It plays every episode with the `client` given (whose base URL is the episode's own scope on the env
rank's endpoint) and returns the episode's reward, a float or an `Outcome`; every turn is recorded token
for token (see `rollart_hpc.envs.openai_server` and `rollart_hpc.tasks.chat_api`).

A text `gymnasium.Env` (string observations and actions) becomes a family through `gymnasium_family`::

    [[envs.plugins]]
    name = "guess"
    factory = "rollart_hpc.api:gymnasium_family"
    options = { name = "guess", env = "guess_env:GuessEnv", oracle = "guess_env:solve", num_tasks = 16 }

(task `guess/<seed>` is the episode `env.reset(seed=seed)` starts; see `GymTextFamily` for the options).
Task sets from files (`[[envs.datasets]]`) need no code at all. Every bad import
path, missing attribute or broken contract is reported in one line naming the config key when
`launch.py run` starts (exit 2).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from rollart_hpc.contracts.generation import LLMClient, RequestOutput, SamplingParams
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.tasks.agent_loop import AgentConfig, run_episode
from rollart_hpc.tasks.chat import ChatTokens
from rollart_hpc.tasks.chat_api import AgentOutcome
from rollart_hpc.tasks.families.calc_math import answer_matches, parse_action
from rollart_hpc.tasks.families.gym_text import gymnasium_family
from rollart_hpc.tasks.registry import Family
from rollart_hpc.tasks.rewards import RewardInput, RewardOutput, agent_return, env_won
from rollart_hpc.tasks.types import AsyncEnv, Env, EnvError, StepResult, Task

__all__ = [
    "Agent",
    "AgentConfig",
    "AsyncEnv",
    "ChatTokens",
    "Env",
    "EnvError",
    "LLMClient",
    "OpenAIAgent",
    "Outcome",
    "RequestOutput",
    "SamplingParams",
    "StepResult",
    "Trajectory",
    "Family",
    "FamilyFactory",
    "RewardFunction",
    "RewardInput",
    "RewardOutput",
    "Task",
    "agent_return",
    "answer_matches",
    "env_won",
    "gymnasium_family",
    "parse_action",
    "run_episode",
]


class FamilyFactory(Protocol):
    """What `envs.plugins[].factory` names: called with the table's `options` as keywords."""

    def __call__(self, **options: Any) -> Family: ...


RewardFunction = Callable[[RewardInput], RewardOutput] | Callable[[RewardInput], Awaitable[RewardOutput]]
"""What `reward.functions.<family>` names: the reward of one finished episode from what it recorded."""


class Agent(Protocol):
    """The signature of an agent: play `task` to its end through `env` (reset, then one step per reply),
    generating every reply with `client` (token ids in; sampled ids, their log-probs and policy versions
    out) under `chat`'s template and `cfg`'s limits, and record the episode in `traj` (returned). The
    built-in agent is `run_episode` (`rollart_hpc.tasks.agent_loop`), which env ranks run for every episode."""

    async def __call__(
        self,
        task: Task,
        env: AsyncEnv,
        client: LLMClient,
        chat: ChatTokens,
        cfg: AgentConfig,
        traj: Trajectory,
    ) -> Trajectory: ...


class OpenAIAgent(Protocol):
    """The signature of an agent of the run's own (`envs.agent`): play `task` (its `system` and `prompt`
    texts are the natural first messages) by calling `client.chat.completions.create(...)` (an
    `openai.AsyncOpenAI` scoped to this episode; non-streaming, one request at a time, every request
    repeating the conversation so far with the returned assistant messages; tools in OpenAI's function
    form, calls back in `message.tool_calls`), and return the episode's reward: a float (success when
    > 0) or an `Outcome`. An exception ends the episode as failed (cause "agent_error"), never the run;
    a request refused for the task's turn limit or the context length ends it "max_turns" /
    "context_limit" whatever the agent does then. The float becomes the trajectory's `env_return` and is
    its reward, unless `reward.functions` names a function for the task's family."""

    async def __call__(self, client: Any, task: Task) -> float | AgentOutcome: ...


Outcome = AgentOutcome
"""What an `OpenAIAgent` may return instead of a float: `Outcome(reward, success=None)`; success None
means reward > 0."""


BUILTIN_AGENT: Agent = run_episode
"""The agent of every run (mypy checks that it follows `Agent`)."""
