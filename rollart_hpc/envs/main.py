"""Env rank of an RL run: many episodes at once (asyncio), LLM turns served by rollout ranks over MPI.

The event loop runs one pump task that polls the mailbox every millisecond: DISPATCH starts an episode
task, OUTPUT resolves the awaiting `generate`, STOP ends the run. Each episode runs through the
`EnvWorker` (env in a child process, time limits, fault isolation); a finished ok trajectory goes to a
reward rank (round robin) for scoring, a failed one straight to the controller. On STOP, pending LLM
requests are answered with finish reason "abort", so in-flight episodes end (failed, cause "abort") and
are reported: the controller accounts for every ticket. Evaluation tickets (`tasks.episodes`) run the
same way; a greedy one samples every turn at temperature 0, and an evaluation request's seed does not
depend on the round, so rounds are comparable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_hpc.cluster.context import RunContext
from rollart_hpc.cluster.mailbox import Mailbox
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.atomic import atomic_write_bytes
from rollart_hpc.contracts.generation import RequestOutput, SamplingParams
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.contracts.records import EpisodeTicket, RankStats, Ready, WorkerStart
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.envs.worker import EnvWorker, EnvWorkerConfig
from rollart_hpc.metrics.timeline import Timeline
from rollart_hpc.routing.router import PoolSpec, Router, episode_of
from rollart_hpc.tasks.agent_loop import AgentConfig
from rollart_hpc.tasks.build import family_specs, playable_tasks
from rollart_hpc.tasks.episodes import is_greedy_episode, seed_key
from rollart_hpc.tasks.plugins import load_callable
from rollart_hpc.tasks.types import Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def pool_specs(config: Config, ctx: RunContext) -> list[PoolSpec]:
    """The run's rollout pools as the router sees them: ranks, engine slots, tags."""
    ranks = ctx.pools
    return [
        PoolSpec(p.name, tuple(ranks[p.name]), p.num_slots or config.rollout.num_slots, tuple(p.tags))
        for p in config.roles.pools()
    ]


class MPIClient:
    """`LLMClient` over MPI: each request goes to the rollout rank its `Router` picks (`routing.policy`)."""

    def __init__(self, mailbox: Mailbox, seed: int, router: Router) -> None:
        self.mailbox, self.seed, self.router = mailbox, seed, router
        self.futures: dict[str, tuple[asyncio.Future[RequestOutput], int]] = {}
        self.cancelled: set[str] = set()

    def route(self, request_id: str, prompt_tokens: int = 0, max_tokens: int = 0) -> int:
        return self.router.route(request_id, prompt_tokens, max_tokens)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> RequestOutput:
        if episode_of(request_id) in self.cancelled:
            return RequestOutput(request_id, [], finished=True, finish_reason="abort")
        rank = self.route(request_id, len(prompt_token_ids), sampling.max_tokens)
        # A per-request seed makes a run reproducible whatever the engine batches together.
        sampling = dataclasses.replace(
            sampling, seed=zlib.crc32(f"{self.seed}:{seed_key(request_id)}".encode())
        )
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.futures[request_id] = (future, rank)
        self.mailbox.send((request_id, prompt_token_ids, sampling), rank, Tag.GENERATE)
        return await future

    def cancel(self, episode_id: str) -> None:
        """End an episode now: its pending turn (and every later one) is answered "abort"."""
        if episode_id not in self.router.episodes:
            return  # already ended (its trajectory is on its way)
        self.cancelled.add(episode_id)
        for request_id, (_, rank) in list(self.futures.items()):
            if episode_of(request_id) == episode_id:
                self.mailbox.send(request_id, rank, Tag.ABORT)

    async def abort(self, request_id: str) -> None:
        entry = self.futures.pop(request_id, None)
        if entry is not None:
            self.mailbox.send(request_id, entry[1], Tag.ABORT)

    def resolve(self, out: RequestOutput) -> None:
        entry = self.futures.pop(out.request_id, None)
        self.router.on_output(out.request_id, len(out.token_ids))
        if entry is not None and not entry[0].done():
            entry[0].set_result(out)

    def abort_all(self) -> None:
        for request_id, (future, rank) in list(self.futures.items()):
            self.mailbox.send(request_id, rank, Tag.ABORT)
            self.router.forget(request_id)
            if not future.done():
                future.set_result(RequestOutput(request_id, [], finished=True, finish_reason="abort"))
        self.futures.clear()


class EnvRank:
    def __init__(self, config: Config, ctx: RunContext, worker: EnvWorker, tasks: dict[str, Task]) -> None:
        self.config, self.ctx, self.worker, self.tasks = config, ctx, worker, tasks
        self.greedy = dataclasses.replace(worker.agent, temperature=0.0)
        router = Router(config.routing, pool_specs(config, ctx))
        self.client = MPIClient(ctx.mailbox, config.run.seed, router)
        self.running: set[asyncio.Task[None]] = set()
        self.rewards = itertools.cycle(ctx.ranks["reward"]) if ctx.ranks["reward"] else None
        self.stopping = False
        self.busy_s = 0.0
        self.timeline = Timeline("env", ctx.world.rank)

    async def episode(self, ticket: EpisodeTicket) -> None:
        start = time.perf_counter()
        task = self.tasks[ticket.task_id]
        dispatch = ticket.dispatch_record(self.ctx.world.rank, task.family)
        agent = self.greedy if is_greedy_episode(ticket.episode_id) else None
        self.client.router.begin(ticket.episode_id, task.family, task.tags)
        with self.timeline.span():
            traj = await self.worker.run_episode(
                task, self.client, dispatch=dispatch, episode_id=ticket.episode_id, agent=agent
            )
        self.client.router.end(ticket.episode_id)
        self.client.cancelled.discard(ticket.episode_id)
        self.busy_s += time.perf_counter() - start
        if traj.status == "ok" and self.rewards is not None:
            self.ctx.mailbox.send(traj, next(self.rewards), Tag.SCORE)
        else:
            self.ctx.mailbox.send(traj, 0, Tag.RESULT)

    def start_episode(self, ticket: EpisodeTicket) -> None:
        task = asyncio.create_task(self.episode(ticket))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    def log_decision(self, decision: dict[str, object] | None) -> None:
        if decision is not None:
            self.ctx.log.info(f"routing decision: {json.dumps(decision, sort_keys=True)}")

    def write_routing(self, run_dir: Path) -> None:
        """run_dir/routing/env-<rank>.json: the policy, per-pool metrics and every affinity decision."""
        router = self.client.router
        report = {
            "policy": router.routing.policy,
            "pools": router.metrics(),
            "decisions": router.decisions,
            "fallback_events": router.fallback_events,
        }
        target = RunLayout(run_dir).routing / f"env-{self.ctx.world.rank}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, json.dumps(report, indent=1, sort_keys=True).encode())

    async def pump(self) -> None:
        mailbox = self.ctx.mailbox
        while not self.stopping or self.running:
            for msg in mailbox.poll():
                if msg.tag == Tag.DISPATCH:
                    self.start_episode(msg.payload)
                elif msg.tag == Tag.CANCEL:
                    self.client.cancel(msg.payload)
                elif msg.tag == Tag.LOAD:
                    self.client.router.on_load(msg.payload)
                elif msg.tag == Tag.OUTPUT:
                    self.client.resolve(msg.payload)
                elif msg.tag == Tag.STOP:
                    self.stopping = True
            if self.stopping:
                self.client.abort_all()
            for task in [t for t in self.running if t.done()]:
                task.result()  # an exception in an episode task is a bug: surface it
            self.log_decision(self.client.router.maybe_adapt())
            mailbox.check()
            await asyncio.sleep(0.001)


async def serve(config: Config, ctx: RunContext, tokenizer: PreTrainedTokenizerBase) -> float:
    specs = family_specs(config.envs, config.run.python_path)
    evaluates = config.controller.eval_every_steps > 0 or config.run.job == "eval"
    tasks = playable_tasks(config.envs, heldout=evaluates)
    worker_config = EnvWorkerConfig.from_config(config.envs, config.run.seed)
    agent = AgentConfig.from_config(config.rollout)
    own_agent = load_callable(config.envs.agent, config.run.python_path) if config.envs.agent else None
    async with EnvWorker(worker_config, agent, tokenizer, specs, own_agent, config.envs.agent_host) as worker:
        rank = EnvRank(config, ctx, worker, tasks)
        await rank.pump()
        if worker.server is not None:
            ctx.log.info(f"chat-completions endpoint: {dict(worker.server.stats)}")
        rank.timeline.write(ctx.run_dir)
        rank.write_routing(ctx.run_dir)
        return rank.busy_s


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    from rollart_hpc.models.tokenizer import load_tokenizer

    start: WorkerStart = ctx.mailbox.wait_for(Tag.START, source=0).payload
    tokenizer = load_tokenizer(Path(start.model_dir))
    ctx.mailbox.send(Ready(), 0, Tag.READY)
    busy_s = asyncio.run(serve(config, ctx, tokenizer))
    ctx.mailbox.send(RankStats("env", busy_s), 0, Tag.STATS)
    ctx.mailbox.flush()
