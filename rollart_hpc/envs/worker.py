"""Env worker: runs many episodes concurrently (asyncio), each env in an isolated child process.

Dataflow: `run_episode` takes a free slot (at most `num_slots` episodes run at once, one child process
per slot), drives the agent loop against a `ChildProcessEnv` bound to that slot's child, and returns a
`Trajectory`. The event loop never blocks on a child: replies are awaited through `loop.add_reader`
on the pipe with a per-request deadline (`reset_timeout_s`, `step_timeout_s`, never past the episode's
deadline `episode_timeout_s`, which bounds the episode's whole wall time including LLM turns).

With an agent of the run's own (`openai_agent`, `envs.agent`), an episode is that agent's call through
the worker's chat-completions endpoint (`rollart_hpc.envs.openai_server`), in a slot, under the same
episode deadline; no env child is started.

Failure handling, the invariant: every episode returns a Trajectory and the worker stays up.
- the child exits (crash) -> EOF on the pipe -> failed trajectory, cause "crash";
- no reply by the deadline (hang) or the episode deadline passes -> cause "timeout";
- the env raises -> the child answers with an error -> cause "error".
After a crash or timeout, or whenever a request was left unanswered (cancellation), the slot's child
is killed by pid and reaped; the slot starts a fresh child on its next use. `counts` holds the
number of finished episodes per finish cause. `close()` ends every child (request, then SIGKILL after
a grace period) and reaps it; `live_pids()` lists the children still running.

Children start through multiprocessing's "forkserver" by default (forking the threaded parent
directly is unsafe; "spawn" re-imports everything per child). The fork server is one helper process
shared by the whole parent process, preloaded with the child module; it holds no env and exits with
the parent.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollart_hpc.config.derive import derive
from rollart_hpc.config.schema import EnvsConfig
from rollart_hpc.contracts.generation import LLMClient
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.envs.child import child_main
from rollart_hpc.envs.faults import FAULTS_FROM_SECTION, LATENCY_FROM_SECTION, FaultConfig
from rollart_hpc.tasks.agent_loop import AgentConfig, fail, new_trajectory, run_episode
from rollart_hpc.tasks.chat import ChatTokens
from rollart_hpc.tasks.registry import FamilySpec
from rollart_hpc.tasks.types import EnvError, StepResult, Task

if TYPE_CHECKING:
    from rollart_hpc.envs.openai_server import ChatServer, OpenAIAgentFn


@dataclass(frozen=True)
class EnvWorkerConfig:
    """Concurrency, time limits and (for tests and benchmarks) injected faults of an env worker."""

    num_slots: int = 8
    reset_timeout_s: float = 60.0
    step_timeout_s: float = 30.0
    episode_timeout_s: float = 900.0
    close_grace_s: float = 2.0
    start_method: str = "forkserver"
    faults: FaultConfig = field(default_factory=FaultConfig)

    @classmethod
    def from_config(cls, envs: EnvsConfig, seed: int) -> EnvWorkerConfig:
        """The run's env worker: slots and time limits from `envs`, faults seeded with the run seed."""
        faults = FAULTS_FROM_SECTION(envs.faults, seed=seed, latency=LATENCY_FROM_SECTION(envs.faults))
        return WORKER_FROM_SECTION(envs, faults=faults)

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.start_method not in ("fork", "forkserver", "spawn"):
            raise ValueError(f"unknown start_method {self.start_method!r}")


WORKER_FROM_SECTION = derive(
    EnvWorkerConfig, EnvsConfig, given=("faults",), kept=("reset_timeout_s", "close_grace_s", "start_method")
)
"""Slots and time limits of the [envs] section's fields of the same name."""


class _Child:
    """One env child process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, faults: FaultConfig) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(child_conn, faults), daemon=True)
        self.proc.start()
        child_conn.close()
        self.pending = False

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    async def call(self, msg: tuple, timeout_s: float) -> Any:
        """Send one request and await its answer; EnvError on crash, timeout or env error."""
        self.pending = True
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise EnvError("crash", f"child {self.pid} gone: {exc}") from None
        await self._readable(timeout_s)
        try:
            status, payload = self.conn.recv()
        except (EOFError, ConnectionResetError):
            self.proc.join(1.0)
            raise EnvError("crash", f"child {self.pid} exited with code {self.proc.exitcode}") from None
        self.pending = False
        if status == "error":
            raise EnvError("error", str(payload))
        return payload

    async def _readable(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, _resolve, ready)
        try:
            await asyncio.wait_for(ready, max(timeout_s, 0.0))
        except TimeoutError:
            raise EnvError("timeout", f"child {self.pid}: no answer within {timeout_s:.2f} s") from None
        finally:
            loop.remove_reader(fd)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()

    def close(self, grace_s: float) -> None:
        try:
            if not self.pending:
                self.conn.send(("close",))
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # already gone; the join below reaps it
        self.proc.join(grace_s)
        self.kill()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class ChildProcessEnv:
    """The AsyncEnv of one episode, backed by a slot's child process."""

    def __init__(self, child: _Child, spec: FamilySpec, episode_id: str, cfg: EnvWorkerConfig) -> None:
        self.child, self.spec, self.episode_id, self.cfg = child, spec, episode_id, cfg
        self.deadline = time.monotonic() + cfg.episode_timeout_s
        self.steps = 0

    def _timeout(self, limit_s: float) -> float:
        return min(limit_s, self.deadline - time.monotonic())

    async def reset(self, task_id: str) -> str:
        msg = ("reset", self.spec, task_id, self.episode_id)
        return str(await self.child.call(msg, self._timeout(self.cfg.reset_timeout_s)))

    async def step(self, action_text: str) -> StepResult:
        msg = ("step", action_text, self.steps)
        self.steps += 1
        obs, reward, done, info = await self.child.call(msg, self._timeout(self.cfg.step_timeout_s))
        return StepResult(str(obs), float(reward), bool(done), dict(info))


class EnvWorker:
    """Runs episodes of the registered families; use as `async with EnvWorker(...) as worker`."""

    def __init__(
        self,
        cfg: EnvWorkerConfig,
        agent: AgentConfig,
        tokenizer: Any,
        families: dict[str, FamilySpec] | None = None,
        openai_agent: OpenAIAgentFn | None = None,
        agent_host: str = "127.0.0.1",
    ) -> None:
        self.cfg, self.agent = cfg, agent
        self.chat = ChatTokens(tokenizer)
        self.openai_agent, self.agent_host = openai_agent, agent_host
        self.server: ChatServer | None = None
        self._server_lock = asyncio.Lock()
        self.families = dict(families or {})
        self.counts: Counter[str] = Counter()
        self._ctx = mp.get_context(cfg.start_method)
        if cfg.start_method == "forkserver":
            self._ctx.set_forkserver_preload(["rollart_hpc.envs.child"])
        self._slots: asyncio.Queue[_Child | None] | None = None
        self._children: dict[int, _Child] = {}
        self._ids = itertools.count()

    async def __aenter__(self) -> EnvWorker:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None
        self.close()

    async def chat_server(self) -> ChatServer:
        """The chat-completions endpoint of an OpenAI-client agent, started on first use."""
        async with self._server_lock:  # episodes start at once: one server
            if self.server is None:
                from rollart_hpc.envs.openai_server import ChatServer

                server = ChatServer(self.chat, self.agent, host=self.agent_host)
                await server.start()
                self.server = server
            return self.server

    def start(self) -> None:
        self._slots = asyncio.Queue()
        for _ in range(self.cfg.num_slots):
            self._slots.put_nowait(None)  # a slot without a child yet

    def live_pids(self) -> set[int]:
        return {pid for pid, c in self._children.items() if c.proc.is_alive()}

    def _spec(self, family: str) -> FamilySpec:
        return self.families.get(family) or FamilySpec(family)

    async def run_episode(
        self,
        task: Task,
        client: LLMClient,
        dispatch: dict | None = None,
        episode_id: str | None = None,
        agent: AgentConfig | None = None,
    ) -> Trajectory:
        """Play one episode; always returns a Trajectory (failed ones carry their cause). `agent`
        replaces the worker's agent settings for this episode (e.g. greedy evaluation)."""
        if self._slots is None:
            raise RuntimeError("EnvWorker.start() was not called")
        eid = episode_id or f"{task.id}#{next(self._ids)}"
        traj = new_trajectory(task, eid, dispatch)
        if self.openai_agent is not None:
            return await self._run_openai_agent(self.openai_agent, task, client, agent or self.agent, traj)
        child = await self._slots.get()
        try:
            child = child or self._spawn()
            env = ChildProcessEnv(child, self._spec(task.family), eid, self.cfg)
            try:
                async with asyncio.timeout(self.cfg.episode_timeout_s):
                    await run_episode(task, env, client, self.chat, agent or self.agent, traj)
            except TimeoutError:
                fail(traj, "timeout", f"episode exceeded {self.cfg.episode_timeout_s} s")
        finally:
            if child is not None and child.pending:  # unanswered request: the child's state is unknown
                self._discard(child)
                child = None
            self._slots.put_nowait(child)
        self.counts[traj.finish_cause] += 1
        return traj

    async def _run_openai_agent(
        self, fn: OpenAIAgentFn, task: Task, client: LLMClient, agent: AgentConfig, traj: Trajectory
    ) -> Trajectory:
        """One episode of an OpenAI-client agent (no env child: the agent is its own env), in a slot."""
        from rollart_hpc.envs.openai_server import run_agent_episode

        assert self._slots is not None
        server = await self.chat_server()
        slot = await self._slots.get()
        try:
            limit = self.cfg.episode_timeout_s
            try:
                async with asyncio.timeout(limit):
                    await run_agent_episode(fn, server, task, client, agent, traj, timeout_s=limit)
            except TimeoutError:
                fail(traj, "timeout", f"episode exceeded {limit} s")
        finally:
            self._slots.put_nowait(slot)
        self.counts[traj.finish_cause] += 1
        return traj

    async def run_many(
        self, tasks: list[Task], client: LLMClient, episode_ids: list[str] | None = None
    ) -> list[Trajectory]:
        ids: list[str | None] = list(episode_ids) if episode_ids else [None] * len(tasks)
        runs = (self.run_episode(t, client, None, e) for t, e in zip(tasks, ids, strict=True))
        return list(await asyncio.gather(*runs))

    def _spawn(self) -> _Child:
        child = _Child(self._ctx, self.cfg.faults)
        self._children[child.pid] = child
        return child

    def _discard(self, child: _Child) -> None:
        child.kill()
        self._children.pop(child.pid, None)

    def close(self) -> None:
        """End and reap every child (graceful close request, SIGKILL after `close_grace_s`)."""
        for child in list(self._children.values()):
            child.close(self.cfg.close_grace_s)
        self._children.clear()
        self._slots = None
