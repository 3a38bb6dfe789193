"""An OpenAI-compatible chat-completions endpoint on an env rank, and the episodes of an OpenAI-client agent.

A run that names `envs.agent` ("package.module:run", an `async def run(client, task)`) plays every episode
by calling that function with an `openai.AsyncOpenAI` client whose base URL is the episode's own scope
on this server: `http://<envs.agent_host>:<port>/episodes/<key>/v1`, where `key` is a random token made
for the episode (also its api key: a request that carries another bearer key is refused, 401). A request
to a scope that is unknown or already closed is a 404 JSON error, so concurrent agents never mix.

Endpoints (JSON in and out, OpenAI's error shape `{"error": {"message", "type", "code"}}`):
- `GET  .../v1/models`: the one model, `model_id`;
- `POST .../v1/chat/completions`: non-streaming. Refused with 400: `stream: true`, `n` other than 1, a
  malformed body, a `temperature` / `top_p` other than the run's rollout sampling (the trainer's log-probs
  assume the run's temperature; an evaluation episode samples greedily whatever the request says),
  a `tool_choice` other than "auto" / "none" ("none": the reply is plain content), an edited history,
  a request past the task's turn limit (`max_turns`) or one whose prompt leaves fewer than
  `min_new_tokens` of context (code `context_length_exceeded`); one request of an episode at a time. `max_tokens` /
  `max_completion_tokens` are honoured up to the run's `max_new_tokens` and the context left, `stop`
  strings (up to 4) end the reply; `model`, `seed`, `logprobs` and other fields are ignored.
Each request is one turn through the env rank's `LLMClient` (request id `RequestId.of_turn(episode, turn)`,
sampling from the run's `AgentConfig`), recorded token for token by `rollart_hpc.tasks.chat_api`.

The episode (`run_agent_episode`): the agent's float (or `AgentOutcome`) becomes the trajectory's `env_return`
and `env_won` (reward > 0 unless the AgentOutcome says), finish cause "done" ("max_turns" / "context_limit"
when the agent met that refusal, whether it then returned or raised). Failed ("failed" status, reward 0):
an exception from the agent or a return that is neither a number nor an `AgentOutcome` ("agent_error"), an
episode that made no request ("agent_error"), an engine answer "abort" / "error" ("abort" / "llm_error",
the agent got a 500). Closing a scope (episode end, time limit, cancellation) aborts its in-flight request.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rollart_hpc.contracts.generation import LLMClient, RequestOutput
from rollart_hpc.contracts.ids import RequestId
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.tasks.agent_loop import AgentConfig, fail
from rollart_hpc.tasks.chat import ChatTokens
from rollart_hpc.tasks.chat_api import AgentOutcome, ChatRequestError, Conversation
from rollart_hpc.tasks.types import Task

OpenAIAgentFn = Callable[[Any, Task], Awaitable[Any]]


def _error(status: int, message: str, code: str = "invalid_request_error") -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code}}, status=status)


@dataclass
class EpisodeScope:
    """One episode's endpoint: its key, conversation and state."""

    key: str
    base_url: str
    task: Task
    traj: Trajectory
    client: LLMClient
    cfg: AgentConfig
    conv: Conversation
    turn: int = 0
    busy: bool = False
    request_id: str = ""
    gen: asyncio.Future[RequestOutput] | None = None
    failure: tuple[str, str] | None = None  # (cause, detail) of a failed engine answer
    limit: str = ""  # "max_turns" / "context_limit" once a request was refused for it
    replied_at: float = field(default_factory=time.monotonic)


class ChatServer:
    """The endpoint of one env rank (see the module docstring); `async with ChatServer(...)`."""

    def __init__(
        self,
        chat: ChatTokens,
        run_cfg: AgentConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        model_id: str = "policy",
    ) -> None:
        self.chat, self.run_cfg, self.host, self.port, self.model_id = chat, run_cfg, host, port, model_id
        self.scopes: dict[str, EpisodeScope] = {}
        self.stats: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> ChatServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/episodes/{key}/v1/models", self._models)
        app.router.add_post("/episodes/{key}/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        for scope in list(self.scopes.values()):
            await self.close(scope)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, task: Task, traj: Trajectory, client: LLMClient, cfg: AgentConfig) -> EpisodeScope:
        """A new scope for one episode, recorded into `traj`."""
        if self._runner is None:
            raise RuntimeError("ChatServer.start() was not called")
        key = secrets.token_hex(16)
        url = f"http://{self.host}:{self.port}/episodes/{key}/v1"
        scope = EpisodeScope(key, url, task, traj, client, cfg, Conversation(self.chat, traj))
        self.scopes[key] = scope
        return scope

    async def close(self, scope: EpisodeScope) -> None:
        """End a scope: later requests get 404; an in-flight generation is aborted."""
        self.scopes.pop(scope.key, None)
        gen = scope.gen
        if gen is not None and not gen.done():
            gen.cancel()
            await asyncio.shield(scope.client.abort(scope.request_id))

    def _scope(self, request: web.Request) -> EpisodeScope | web.Response:
        scope = self.scopes.get(request.match_info["key"])
        if scope is None:
            return _error(404, "no such episode scope (unknown or finished episode)", "episode_not_found")
        auth = request.headers.get("Authorization")
        if auth is not None and auth != f"Bearer {scope.key}":
            return _error(401, "the api key is not this episode's", "invalid_api_key")
        return scope

    async def _models(self, request: web.Request) -> web.Response:
        scope = self._scope(request)
        if isinstance(scope, web.Response):
            return scope
        model = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "rollart_hpc"}
        return web.json_response({"object": "list", "data": [model]})

    async def _completions(self, request: web.Request) -> web.Response:
        scope = self._scope(request)
        if isinstance(scope, web.Response):
            return scope
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        if scope.failure is not None or scope.limit:
            ended = scope.failure[0] if scope.failure else scope.limit
            return _error(400, f"this episode has ended ({ended})", "episode_ended")
        if scope.busy:
            return _error(400, "another request of this episode is in flight (one at a time)")
        scope.busy = True
        try:
            return await self._turn(scope, body)
        except ChatRequestError as exc:
            return _error(exc.status, str(exc), exc.code)
        finally:
            scope.busy = False

    def _max_tokens(self, scope: EpisodeScope, body: dict[str, Any]) -> int | None:
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is None:
            return None
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ChatRequestError(400, f"max_tokens must be a positive integer, got {limit!r}")
        return limit

    def _check_sampling(self, body: dict[str, Any]) -> tuple[str, ...]:
        if body.get("stream"):
            raise ChatRequestError(400, "stream=true is not supported: request a whole completion")
        if body.get("n", 1) not in (1, None):
            raise ChatRequestError(400, f"n must be 1, got {body.get('n')!r}")
        for key, run_value in (("temperature", self.run_cfg.temperature), ("top_p", self.run_cfg.top_p)):
            value = body.get(key)
            if value is None:
                continue
            if not isinstance(value, int | float) or not math.isclose(float(value), run_value, abs_tol=1e-6):
                raise ChatRequestError(
                    400,
                    f"{key}={value!r} differs from the run's rollout sampling ({key}={run_value}); "
                    "leave it unset (the trainer's log-probs assume the run's sampling)",
                )
        if body.get("tool_choice") not in (None, "auto", "none"):
            raise ChatRequestError(400, "tool_choice must be 'auto' or 'none'")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise ChatRequestError(400, "stop must be a string or a list of up to 4 non-empty strings")
        return tuple(stops)

    async def _turn(self, scope: EpisodeScope, body: dict[str, Any]) -> web.Response:
        stops = self._check_sampling(body)
        asked = self._max_tokens(scope, body)
        traj, cfg = scope.traj, scope.cfg
        if scope.turn >= scope.task.max_turns:
            scope.limit = "max_turns"
            raise ChatRequestError(
                400, f"the task's turn limit ({scope.task.max_turns}) is reached", "max_turns"
            )
        prompt, added = scope.conv.extend(body.get("messages"), body.get("tools"))
        if len(traj.token_ids) + len(prompt) + cfg.min_new_tokens > cfg.max_context_tokens:
            scope.limit = "context_limit"
            raise ChatRequestError(
                400,
                f"the conversation ({len(traj.token_ids) + len(prompt)} tokens) leaves less than "
                f"{cfg.min_new_tokens} of the context ({cfg.max_context_tokens})",
                "context_length_exceeded",
            )
        room = cfg.max_context_tokens - len(traj.token_ids) - len(prompt)
        max_tokens = min(cfg.max_new_tokens, room, asked or cfg.max_new_tokens)
        sampling = cfg.sampling(max_tokens, self.chat.stop_token_ids, stops)
        if scope.turn > 0:
            traj.env_s[-1] = time.monotonic() - scope.replied_at
        scope.request_id = str(RequestId.of_turn(traj.episode_id, scope.turn))
        started = time.monotonic()
        gen = asyncio.ensure_future(
            scope.client.generate(scope.request_id, [*traj.token_ids, *prompt], sampling)
        )
        scope.gen = gen
        try:
            out = await gen
        except asyncio.CancelledError:
            if not gen.cancelled() or _cancelling():
                gen.cancel()
                await asyncio.shield(scope.client.abort(scope.request_id))
                raise
            return _error(503, "this episode has ended", "episode_ended")
        finally:
            scope.gen = None
        problem = _bad_output(out, sampling.max_tokens)
        if problem is not None:
            scope.failure = problem
            return _error(500, problem[1], problem[0])
        malformed = scope.conv.malformed_tool_calls
        parse = body.get("tool_choice") != "none"
        message, text = scope.conv.record(prompt, added, out, scope.turn, parse)
        self.stats["malformed_tool_calls"] += scope.conv.malformed_tool_calls - malformed
        traj.actions.append(text)
        traj.llm_s.append(time.monotonic() - started)
        traj.env_s.append(0.0)
        traj.num_turns += 1
        scope.turn += 1
        scope.replied_at = time.monotonic()
        self.stats["requests"] += 1
        finish = (
            "tool_calls"
            if "tool_calls" in message
            else ("length" if out.finish_reason == "length" else "stop")
        )
        n_prompt = len(traj.token_ids) - len(out.token_ids)
        return web.json_response(
            {
                "id": f"chatcmpl-{scope.request_id}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model") or self.model_id,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": len(out.token_ids),
                    "total_tokens": len(traj.token_ids),
                },
            }
        )


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _bad_output(out: RequestOutput, max_tokens: int) -> tuple[str, str] | None:
    """(cause, detail) when the engine's answer ends the episode as failed."""
    if out.finish_reason in ("error", "abort"):
        cause = "llm_error" if out.finish_reason == "error" else "abort"
        return cause, out.error or f"request {out.request_id} finished with {out.finish_reason}"
    n = len(out.token_ids)
    if n == 0 or len(out.logprobs) != n or len(out.versions) != n or n > max_tokens:
        return "llm_error", f"request {out.request_id}: malformed output ({n} tokens)"
    return None


def outcome_of(result: Any) -> AgentOutcome:
    """The agent's return as an `AgentOutcome`; TypeError for anything else."""
    if isinstance(result, AgentOutcome):
        return result
    if isinstance(result, int | float) and not isinstance(result, bool) and math.isfinite(result):
        return AgentOutcome(float(result))
    raise TypeError(f"the agent returned {type(result).__name__} {result!r}, not a float or an AgentOutcome")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


async def run_agent_episode(
    agent: OpenAIAgentFn,
    server: ChatServer,
    task: Task,
    client: LLMClient,
    cfg: AgentConfig,
    traj: Trajectory,
    timeout_s: float = 600.0,
) -> Trajectory:
    """Play `task` with an OpenAI-client agent through its own scope of `server`, filling `traj`."""
    import openai

    scope = server.open(task, traj, client, cfg)
    try:
        api = openai.AsyncOpenAI(base_url=scope.base_url, api_key=scope.key, max_retries=0, timeout=timeout_s)
        try:
            result = await agent(api, task)
        except Exception as exc:  # the user's agent: any failure ends this episode, never the rank
            if scope.failure is not None:
                return fail(traj, *scope.failure)
            if scope.limit:
                traj.finish_cause = scope.limit
                return _finish(traj, scope)
            return fail(traj, "agent_error", _one_line(exc))
        finally:
            await api.close()
        if scope.failure is not None:
            return fail(traj, *scope.failure)
        try:
            outcome = outcome_of(result)
        except TypeError as exc:
            return fail(traj, "agent_error", str(exc))
        traj.env_return, traj.env_won = outcome.reward, outcome.won
        traj.finish_cause = scope.limit or "done"
        return _finish(traj, scope)
    finally:
        await server.close(scope)


def _finish(traj: Trajectory, scope: EpisodeScope) -> Trajectory:
    if traj.num_turns == 0:
        return fail(traj, "agent_error", "the agent made no chat completion request")
    traj.env_s[-1] = time.monotonic() - scope.replied_at
    return traj
