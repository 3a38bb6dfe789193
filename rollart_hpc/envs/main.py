"""Env rank of an RL run: many episodes at once (asyncio), LLM turns served by rollout ranks over MPI.

The event loop runs one pump task that polls the mailbox every millisecond: DISPATCH starts an episode
task, OUTPUT resolves the awaiting `generate`, STOP ends the run. Each episode runs through the
`EnvWorker` (env in a child process, time limits, fault isolation); a finished ok trajectory goes to a
reward rank (round robin) for scoring, a failed one straight to the controller. On STOP, pending LLM
requests are answered with finish reason "abort", so in-flight episodes end (failed, cause "abort") and
are reported: the controller accounts for every ticket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import zlib
from pathlib import Path
from typing import Any

from rollart_hpc.config.schema import Config
from rollart_hpc.contracts import protocol as proto
from rollart_hpc.metrics.timeline import Timeline
from rollart_hpc.rl_common import RunContext, agent_config, env_worker_config, family_specs
from rollart_hpc.rollout.types import RequestOutput, SamplingParams


class MPIClient:
    """`LLMClient` over MPI: requests go to a rollout rank chosen by episode (prefix affinity)."""

    def __init__(self, ctx: RunContext) -> None:
        self.mailbox = ctx.mailbox
        self.seed = ctx.config.run.seed
        self.rollouts = ctx.ranks["rollout"]
        self.futures: dict[str, tuple[asyncio.Future[RequestOutput], int]] = {}

    def route(self, request_id: str) -> int:
        episode = request_id.split("/", 1)[0]
        return self.rollouts[zlib.crc32(episode.encode()) % len(self.rollouts)]

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> RequestOutput:
        rank = self.route(request_id)
        # A per-request seed makes a run reproducible whatever the engine batches together.
        sampling = dataclasses.replace(sampling, seed=zlib.crc32(f"{self.seed}:{request_id}".encode()))
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.futures[request_id] = (future, rank)
        self.mailbox.send((request_id, prompt_token_ids, sampling), rank, proto.GENERATE)
        return await future

    async def abort(self, request_id: str) -> None:
        entry = self.futures.pop(request_id, None)
        if entry is not None:
            self.mailbox.send(request_id, entry[1], proto.ABORT)

    def resolve(self, out: RequestOutput) -> None:
        entry = self.futures.pop(out.request_id, None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(out)

    def abort_all(self) -> None:
        for request_id, (future, rank) in list(self.futures.items()):
            self.mailbox.send(request_id, rank, proto.ABORT)
            if not future.done():
                future.set_result(RequestOutput(request_id, [], finished=True, finish_reason="abort"))
        self.futures.clear()


class EnvRank:
    def __init__(self, config: Config, ctx: RunContext, worker: Any, tasks: dict[str, Any]) -> None:
        self.config, self.ctx, self.worker, self.tasks = config, ctx, worker, tasks
        self.client = MPIClient(ctx)
        self.running: set[asyncio.Task[None]] = set()
        self.rewards = itertools.cycle(ctx.ranks["reward"]) if ctx.ranks["reward"] else None
        self.stopping = False
        self.busy_s = 0.0
        self.timeline = Timeline("env", ctx.world.rank)

    async def episode(self, ticket: dict[str, Any]) -> None:
        start = time.perf_counter()
        task = self.tasks[ticket["task_id"]]
        with self.timeline.span():
            traj = await self.worker.run_episode(
                task, self.client, dispatch=ticket, episode_id=ticket["episode_id"]
            )
        self.busy_s += time.perf_counter() - start
        if traj.status == "ok" and self.rewards is not None:
            self.ctx.mailbox.send(traj, next(self.rewards), proto.SCORE)
        else:
            self.ctx.mailbox.send(traj, 0, proto.RESULT)

    def start_episode(self, ticket: dict[str, Any]) -> None:
        task = asyncio.create_task(self.episode(ticket))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def pump(self) -> None:
        mailbox = self.ctx.mailbox
        while not self.stopping or self.running:
            for msg in mailbox.poll():
                if msg.tag == proto.DISPATCH:
                    self.start_episode(msg.payload)
                elif msg.tag == proto.OUTPUT:
                    self.client.resolve(msg.payload)
                elif msg.tag == proto.STOP:
                    self.stopping = True
            if self.stopping:
                self.client.abort_all()
            for task in [t for t in self.running if t.done()]:
                task.result()  # an exception in an episode task is a bug: surface it
            mailbox.check()
            await asyncio.sleep(0.001)


async def serve(config: Config, ctx: RunContext, tokenizer: Any) -> float:
    from rollart_hpc.envs.worker import EnvWorker

    specs = family_specs(config)
    tasks = {t.id: t for spec in specs.values() for t in spec.build().tasks()}
    async with EnvWorker(env_worker_config(config), agent_config(config), tokenizer, specs) as worker:
        rank = EnvRank(config, ctx, worker, tasks)
        await rank.pump()
        rank.timeline.write(ctx.run_dir)
        return rank.busy_s


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    from transformers import AutoTokenizer

    model_dir = Path(ctx.mailbox.wait_for(proto.START, source=0).payload["model_dir"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ctx.mailbox.send("ready", 0, proto.READY)
    busy_s = asyncio.run(serve(config, ctx, tokenizer))
    ctx.mailbox.send({"role": "env", "busy_s": busy_s}, 0, proto.STATS)
    ctx.mailbox.flush()
