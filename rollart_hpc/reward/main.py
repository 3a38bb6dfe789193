"""Reward rank of an RL run: scores finished trajectories and forwards them to the controller. Any number
of reward ranks may run; env ranks spread trajectories over them round robin.

Scoring is done by one of two scorers, chosen by config: the rank's own elastic `RewardPool` (workers
start under queue pressure up to `reward.max_workers` and stop after `reward.idle_shutdown_s` idle:
scale to zero), or, with `reward.service` / `reward.service_dir`, a `ServiceClient` of a shared reward
service (`launch.py reward-service`). Each SCORE message is scored in its own task, so trajectories are
scored concurrently; each one goes back to the controller (RESULT) exactly once, scored or failed with a
cause (reward_error: every call raised; reward_unavailable: the service gave no answer before
`reward.service_deadline_s`). On STOP, scoring still in progress is cancelled: the controller has
stopped counting results (it stopped the env ranks first), and they stay in its in-flight count.
The rank reports failures and rebuilds in its STATS (service: failed requests and reconnects) and writes
its full scaling record (cold starts and their latency, per-worker busy seconds, worker-seconds,
service retries) to `run_dir/reward/rank-<r>.json`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Protocol

from rollart_hpc.cluster.context import RunContext
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.contracts.records import RankStats, Ready, Trajectory
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.metrics.timeline import Timeline
from rollart_hpc.tasks.build import own_family_rewards


class Scorer(Protocol):
    async def score(self, traj: Trajectory) -> Trajectory: ...

    def stats(self) -> dict[str, object]: ...

    def rank_counts(self) -> tuple[int, int]: ...

    def close(self) -> None: ...


class BusyClock:
    """Seconds during which at least one trajectory was being scored; each such period is one timeline
    interval (scoring runs concurrently, so per-trajectory spans would overlap)."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline, self.active, self.since, self.busy_s = timeline, 0, 0.0, 0.0

    def enter(self) -> None:
        if self.active == 0:
            self.since = time.time()
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            now = time.time()
            self.busy_s += now - self.since
            self.timeline.add(self.since, now)


async def _score_one(ctx: RunContext, scorer: Scorer, traj: Trajectory, clock: BusyClock) -> None:
    clock.enter()
    try:
        scored = await scorer.score(traj)
    finally:
        clock.leave()
    ctx.mailbox.send(scored, 0, Tag.RESULT)


async def serve(ctx: RunContext, scorer: Scorer) -> float:
    timeline = Timeline("reward", ctx.world.rank)
    clock, stopping = BusyClock(timeline), False
    tasks: set[asyncio.Task[None]] = set()
    scale_down = getattr(scorer, "maybe_scale_down", lambda: 0)
    try:
        while not stopping:
            for msg in ctx.mailbox.poll():
                if msg.tag == Tag.SCORE:
                    task = asyncio.create_task(_score_one(ctx, scorer, msg.payload, clock))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif msg.tag == Tag.STOP:
                    stopping = True
            ctx.mailbox.check()
            scale_down()
            await asyncio.sleep(0.001)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        scorer.close()
    timeline.write(ctx.run_dir)
    return clock.busy_s


def make_scorer(config: Config, rank: int, run_dir: Path) -> Scorer:
    reward = config.reward
    if reward.uses_service:
        from rollart_hpc.reward.client import ServiceClient

        return ServiceClient(reward, client=str(run_dir.resolve()))
    from rollart_hpc.reward.pool import RewardPool
    from rollart_hpc.reward.service import pool_config

    defaults = own_family_rewards(config.envs)
    return RewardPool(pool_config(reward, config.run.seed + rank, defaults, config.run.python_path))


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    ctx.mailbox.wait_for(Tag.START, source=0)
    ctx.mailbox.send(Ready(), 0, Tag.READY)
    scorer = make_scorer(config, ctx.world.rank, run_dir)
    busy_s = asyncio.run(serve(ctx, scorer))
    stats = scorer.stats()
    atomic_write_json(RunLayout(run_dir).reward / f"rank-{ctx.world.rank}.json", {"busy_s": busy_s, **stats})
    failures, rebuilds = scorer.rank_counts()
    ctx.mailbox.send(RankStats("reward", busy_s, failures, rebuilds), 0, Tag.STATS)
    ctx.mailbox.flush()
