"""Oracle runs and demonstrations: the oracle's actions played through the real env interface.

- `run_oracle` plays a task's oracle in-process and reports whether it won;
- `demonstration_messages` is the full chat (system, observations, oracle replies) as the agent would
  see and write it, for supervised warm starts;
- `demonstration_trajectory` runs the same agent loop as training rollouts with a `ScriptedClient`,
  so the demonstration's tokens and action mask match the rollout tokenization exactly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from rollart_hpc.contracts.generation import FinishReason, RequestOutput, SamplingParams
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.tasks.agent_loop import AgentConfig, new_trajectory, run_episode
from rollart_hpc.tasks.chat import ChatTokens, Message
from rollart_hpc.tasks.registry import Family
from rollart_hpc.tasks.types import Env, StepResult, Task


class LocalAsyncEnv:
    """An in-process Env behind the AsyncEnv interface (no isolation; for oracles, demos and tests)."""

    def __init__(self, env: Env) -> None:
        self.env = env

    async def reset(self, task_id: str) -> str:
        return self.env.reset(task_id)

    async def step(self, action_text: str) -> StepResult:
        return StepResult(*self.env.step(action_text))


class ScriptedClient:
    """An LLMClient that replies with fixed texts, in order, encoded with the tokenizer plus a stop token.

    Every reply's tokens carry log-prob 0.0 and policy version `version`.
    """

    def __init__(self, chat: ChatTokens, texts: list[str], version: int = 0) -> None:
        self.chat, self.texts, self.version = chat, list(texts), version
        self.requests: list[tuple[str, list[int]]] = []
        self.aborted: list[str] = []

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> RequestOutput:
        self.requests.append((request_id, list(prompt_token_ids)))
        text = self.texts[len(self.requests) - 1] if len(self.requests) <= len(self.texts) else ""
        ids = self.chat.encode(text) + list(self.chat.stop_token_ids[:1])
        ids = ids[: sampling.max_tokens]
        reason: FinishReason = "stop" if ids and ids[-1] in self.chat.stop_token_ids else "length"
        n = len(ids)
        return RequestOutput(
            request_id, list(prompt_token_ids), ids, [0.0] * n, [self.version] * n, text, True, reason
        )

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@dataclass(frozen=True)
class OracleResult:
    task_id: str
    won: bool
    steps: int
    detail: str = ""


def run_oracle(family: Family, task_id: str, env: Env | None = None) -> OracleResult:
    """Play the oracle of `task_id` through `env.reset/step` (a fresh env when None)."""
    own = env is None
    env = env or family.make_env()
    try:
        env.reset(task_id)
        actions = family.oracle(task_id)
        for k, action in enumerate(actions):
            _, _, done, info = env.step(action)
            if done:
                return OracleResult(task_id, bool(info.get("won")), k + 1)
        return OracleResult(task_id, False, len(actions), "not done after the oracle's last action")
    finally:
        if own:
            env.close()


def demonstration_messages(family: Family, task_id: str) -> list[Message]:
    """The chat of the oracle solving `task_id`: system, then user observation / assistant action turns."""
    task = family.task(task_id)
    env = family.make_env()
    try:
        messages: list[Message] = [{"role": "system", "content": task.system}]
        messages.append({"role": "user", "content": env.reset(task_id)})
        for action in family.oracle(task_id):
            messages.append({"role": "assistant", "content": action})
            obs, _, done, _ = env.step(action)
            if done:
                return messages
            messages.append({"role": "user", "content": obs})
    finally:
        env.close()
    raise RuntimeError(f"oracle of {task_id} does not finish the episode")


def demonstration_trajectory(family: Family, task: Task, tokenizer: Any, cfg: AgentConfig) -> Trajectory:
    """The oracle's episode as a Trajectory (same tokenization and mask as a rollout)."""
    chat = ChatTokens(tokenizer)
    client = ScriptedClient(chat, family.oracle(task.id))
    env = family.make_env()
    try:
        traj = new_trajectory(task, f"{task.id}#oracle")
        return asyncio.run(run_episode(task, LocalAsyncEnv(env), client, chat, cfg, traj))
    finally:
        env.close()
