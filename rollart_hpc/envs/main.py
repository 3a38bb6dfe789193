"""Env rank of an RL run: many episodes at once (asyncio), LLM turns served by rollout ranks over MPI.

The event loop runs one pump task that polls the mailbox every millisecond: DISPATCH starts an episode
task, OUTPUT resolves the awaiting `generate`, STOP ends the run. Each episode runs through the
`EnvWorker` (env in a child process, time limits, fault isolation); a finished ok trajectory goes to a
reward rank (round robin) for scoring, a failed one straight to the controller. On STOP, pending LLM
requests are answered with finish reason "abort", so in-flight episodes end (failed, cause "abort") and
are reported: the controller accounts for every ticket. Evaluation tickets (`envs.episodes`) run the
same way; a greedy one samples every turn at temperature 0, and an evaluation request's seed does not
depend on the round, so rounds are comparable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_hpc.cluster.context import RunContext
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.contracts.records import EpisodeTicket, RankStats, Ready, WorkerStart
from rollart_hpc.envs.agent_loop import AgentConfig
from rollart_hpc.envs.build import family_specs, playable_tasks
from rollart_hpc.envs.episodes import is_greedy_episode, seed_key
from rollart_hpc.envs.types import Task
from rollart_hpc.envs.worker import EnvWorker, EnvWorkerConfig
from rollart_hpc.metrics.timeline import Timeline
from rollart_hpc.rollout.routing import rollout_index
from rollart_hpc.rollout.types import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class MPIClient:
    """`LLMClient` over MPI: requests go to a rollout rank chosen by episode (prefix affinity)."""

    def __init__(self, ctx: RunContext) -> None:
        self.mailbox = ctx.mailbox
        self.seed = ctx.config.run.seed
        self.rollouts = ctx.ranks["rollout"]
        self.futures: dict[str, tuple[asyncio.Future[RequestOutput], int]] = {}

    def route(self, request_id: str) -> int:
        return self.rollouts[rollout_index(request_id, len(self.rollouts))]

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> RequestOutput:
        rank = self.route(request_id)
        # A per-request seed makes a run reproducible whatever the engine batches together.
        sampling = dataclasses.replace(
            sampling, seed=zlib.crc32(f"{self.seed}:{seed_key(request_id)}".encode())
        )
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.futures[request_id] = (future, rank)
        self.mailbox.send((request_id, prompt_token_ids, sampling), rank, Tag.GENERATE)
        return await future

    async def abort(self, request_id: str) -> None:
        entry = self.futures.pop(request_id, None)
        if entry is not None:
            self.mailbox.send(request_id, entry[1], Tag.ABORT)

    def resolve(self, out: RequestOutput) -> None:
        entry = self.futures.pop(out.request_id, None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(out)

    def abort_all(self) -> None:
        for request_id, (future, rank) in list(self.futures.items()):
            self.mailbox.send(request_id, rank, Tag.ABORT)
            if not future.done():
                future.set_result(RequestOutput(request_id, [], finished=True, finish_reason="abort"))
        self.futures.clear()


class EnvRank:
    def __init__(self, config: Config, ctx: RunContext, worker: EnvWorker, tasks: dict[str, Task]) -> None:
        self.config, self.ctx, self.worker, self.tasks = config, ctx, worker, tasks
        self.greedy = dataclasses.replace(worker.agent, temperature=0.0)
        self.client = MPIClient(ctx)
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
        with self.timeline.span():
            traj = await self.worker.run_episode(
                task, self.client, dispatch=dispatch, episode_id=ticket.episode_id, agent=agent
            )
        self.busy_s += time.perf_counter() - start
        if traj.status == "ok" and self.rewards is not None:
            self.ctx.mailbox.send(traj, next(self.rewards), Tag.SCORE)
        else:
            self.ctx.mailbox.send(traj, 0, Tag.RESULT)

    def start_episode(self, ticket: EpisodeTicket) -> None:
        task = asyncio.create_task(self.episode(ticket))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def pump(self) -> None:
        mailbox = self.ctx.mailbox
        while not self.stopping or self.running:
            for msg in mailbox.poll():
                if msg.tag == Tag.DISPATCH:
                    self.start_episode(msg.payload)
                elif msg.tag == Tag.OUTPUT:
                    self.client.resolve(msg.payload)
                elif msg.tag == Tag.STOP:
                    self.stopping = True
            if self.stopping:
                self.client.abort_all()
            for task in [t for t in self.running if t.done()]:
                task.result()  # an exception in an episode task is a bug: surface it
            mailbox.check()
            await asyncio.sleep(0.001)


async def serve(config: Config, ctx: RunContext, tokenizer: PreTrainedTokenizerBase) -> float:
    specs = family_specs(config.envs)
    evaluates = config.controller.eval_every_steps > 0 or config.run.job == "eval"
    tasks = playable_tasks(config.envs, heldout=evaluates)
    worker_config = EnvWorkerConfig.from_config(config.envs, config.run.seed)
    agent = AgentConfig.from_config(config.rollout)
    async with EnvWorker(worker_config, agent, tokenizer, specs) as worker:
        rank = EnvRank(config, ctx, worker, tasks)
        await rank.pump()
        rank.timeline.write(ctx.run_dir)
        return rank.busy_s


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    from transformers import AutoTokenizer

    start: WorkerStart = ctx.mailbox.wait_for(Tag.START, source=0).payload
    tokenizer = AutoTokenizer.from_pretrained(Path(start.model_dir))
    ctx.mailbox.send(Ready(), 0, Tag.READY)
    busy_s = asyncio.run(serve(config, ctx, tokenizer))
    ctx.mailbox.send(RankStats("env", busy_s), 0, Tag.STATS)
    ctx.mailbox.flush()
