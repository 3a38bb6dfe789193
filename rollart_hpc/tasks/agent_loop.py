"""The agent loop: one multi-turn episode of LLM turns and env steps, recorded as a `Trajectory`.

Turn t: the conversation so far (token ids) goes to the `LLMClient`; its generated ids are appended
verbatim with mask 1, their behaviour log-probs and policy versions; the env steps on the generated
text; unless the episode is done, the template text closing the turn plus the observation and the next
generation prompt are appended with mask 0 (see `rollart_hpc.tasks.chat`).

Ending an episode ("ok" status):
- "done": the env reported done (won or lost);
- "max_turns": `task.max_turns` turns without done;
- "context_limit": fewer than `min_new_tokens` tokens would remain for the next generation, either
  before a turn or because the next observation would not fit; the observation is then not appended,
  so a trajectory never exceeds `max_context_tokens`.
Failures ("failed" status, reward 0): an `EnvError` (crash, timeout, error) from the env, an engine
result with finish reason "error" or "abort", or an engine result that breaks the `RequestOutput`
contract (llm_error). On cancellation (episode time limit) the in-flight request is aborted.
Per-turn fields (`actions`, `llm_s`, `env_s`, `num_turns`) are appended together after a turn's env
step, so a trajectory cut short mid-turn stays consistent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from rollart_hpc.config.derive import derive
from rollart_hpc.config.schema import RolloutConfig
from rollart_hpc.contracts.generation import LLMClient, RequestOutput, Sampling, SamplingParams
from rollart_hpc.contracts.ids import RequestId
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.tasks.chat import ChatTokens, Message
from rollart_hpc.tasks.types import AsyncEnv, EnvError, Task


@dataclass(frozen=True)
class AgentConfig(Sampling):
    """Sampling (the inherited `Sampling` fields) and context policy of the agent loop."""

    max_context_tokens: int = 1024
    max_new_tokens: int = 48
    min_new_tokens: int = 4

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> AgentConfig:
        """The run's agent loop: context length and sampling of the rollout engines."""
        return AGENT_FROM_ROLLOUT(rollout)

    def sampling(
        self, max_tokens: int, stop_ids: tuple[int, ...], stop: tuple[str, ...] = ()
    ) -> SamplingParams:
        """The parameters of one turn's request: this config's distribution, `max_tokens`, stops."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            stop_token_ids=stop_ids,
            stop=stop,
        )


AGENT_FROM_ROLLOUT = derive(
    AgentConfig, RolloutConfig, rename={"max_context_tokens": "max_model_len"}, kept=("min_new_tokens",)
)
"""Context length and sampling of the [rollout] section's engines."""


def new_trajectory(task: Task, episode_id: str, dispatch: dict | None = None) -> Trajectory:
    return Trajectory(task.id, task.family, task.tags, episode_id, dispatch=dict(dispatch or {}))


def fail(traj: Trajectory, cause: str, detail: str) -> Trajectory:
    traj.status, traj.finish_cause, traj.error = "failed", cause, detail
    traj.reward, traj.success = 0.0, False
    return traj


async def run_episode(
    task: Task, env: AsyncEnv, client: LLMClient, chat: ChatTokens, cfg: AgentConfig, traj: Trajectory
) -> Trajectory:
    """Play `task` to its end, filling `traj` in place (also returned)."""
    try:
        started = time.monotonic()
        observation = await env.reset(task.id)
        traj.reset_s = time.monotonic() - started
        history: list[Message] = [{"role": "system", "content": task.system}]
        history.append({"role": "user", "content": observation})
        traj.append(chat.prompt_ids(history), False, [], [])
        traj.prompt_len = len(traj.token_ids)
        traj.finish_cause = await _turns(task, env, client, chat, cfg, traj, history)
    except EnvError as exc:
        return fail(traj, exc.cause, exc.detail)
    except _LLMError as exc:
        return fail(traj, exc.cause, str(exc))
    return traj


class _LLMError(Exception):
    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


async def _turns(
    task: Task,
    env: AsyncEnv,
    client: LLMClient,
    chat: ChatTokens,
    cfg: AgentConfig,
    traj: Trajectory,
    history: list[Message],
) -> str:
    for turn in range(task.max_turns):
        room = cfg.max_context_tokens - len(traj.token_ids)
        if room < cfg.min_new_tokens:
            return "context_limit"
        started = time.monotonic()
        request_id = str(RequestId.of_turn(traj.episode_id, turn))
        out = await _generate(client, request_id, traj.token_ids, cfg, chat, room, task.stop)
        llm_s = time.monotonic() - started
        _append_generated(traj, out)
        action = chat.assistant_text(out.token_ids)
        started = time.monotonic()
        result = await env.step(action)
        _record_turn(
            traj, action, llm_s, time.monotonic() - started, result.reward, bool(result.info.get("won"))
        )
        if result.done:
            return "done"
        history.append({"role": "assistant", "content": chat.assistant_content(out.token_ids)})
        cont = chat.continuation_ids(history[:-1], out.token_ids, result.observation)
        history.append({"role": "user", "content": result.observation})
        if len(traj.token_ids) + len(cont) + cfg.min_new_tokens > cfg.max_context_tokens:
            return "context_limit"
        traj.append(cont, False, [], [])
    return "max_turns"


async def _generate(
    client: LLMClient,
    request_id: str,
    prompt: list[int],
    cfg: AgentConfig,
    chat: ChatTokens,
    room: int,
    stop: tuple[str, ...],
) -> RequestOutput:
    sampling = cfg.sampling(min(cfg.max_new_tokens, room), chat.stop_token_ids, stop)
    try:
        out = await client.generate(request_id, list(prompt), sampling)
    except asyncio.CancelledError:
        await asyncio.shield(client.abort(request_id))
        raise
    if out.finish_reason in ("error", "abort"):
        cause = "llm_error" if out.finish_reason == "error" else "abort"
        raise _LLMError(cause, out.error or f"request {request_id} finished with {out.finish_reason}")
    n = len(out.token_ids)
    if n == 0 or len(out.logprobs) != n or len(out.versions) != n or n > sampling.max_tokens:
        raise _LLMError("llm_error", f"request {request_id}: malformed output ({n} tokens)")
    return out


def _append_generated(traj: Trajectory, out: RequestOutput) -> None:
    traj.append(list(out.token_ids), True, list(out.logprobs), list(out.versions))


def _record_turn(traj: Trajectory, action: str, llm_s: float, env_s: float, reward: float, won: bool) -> None:
    traj.actions.append(action)
    traj.llm_s.append(llm_s)
    traj.env_s.append(env_s)
    traj.num_turns += 1
    traj.env_return += reward
    traj.env_won = traj.env_won or won
