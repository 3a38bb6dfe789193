"""Reward rank of an RL run: scores finished trajectories with the stateless per-family reward functions
(`rollart_hpc.reward`) and forwards them to the controller. Any number of reward ranks may run; env ranks
spread trajectories over them round robin. A failing reward call is retried (`reward.max_score_attempts`,
the worker pool rebuilt when it broke); a trajectory that cannot be scored goes to the controller failed
(cause reward_error). The rank reports its failed calls and pool rebuilds in its STATS."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rollart_hpc.cluster.context import RunContext
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.contracts.records import RankStats, Ready
from rollart_hpc.metrics.timeline import Timeline
from rollart_hpc.reward.pool import RewardPool, RewardPoolConfig


async def serve(ctx: RunContext, pool: RewardPool) -> float:
    busy_s, stopping = 0.0, False
    timeline = Timeline("reward", ctx.world.rank)
    try:
        while not stopping:
            for msg in ctx.mailbox.poll():
                if msg.tag == Tag.SCORE:
                    start = time.perf_counter()
                    with timeline.span():
                        ctx.mailbox.send(await pool.score(msg.payload), 0, Tag.RESULT)
                    busy_s += time.perf_counter() - start
                elif msg.tag == Tag.STOP:
                    stopping = True
            ctx.mailbox.check()
            await asyncio.sleep(0.001)
    finally:
        pool.close()
    timeline.write(ctx.run_dir)
    return busy_s


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    ctx.mailbox.wait_for(Tag.START, source=0)
    ctx.mailbox.send(Ready(), 0, Tag.READY)
    reward = config.reward
    pool = RewardPool(
        RewardPoolConfig(
            max_attempts=reward.max_score_attempts,
            fault_prob=reward.fault_prob,
            fault_seed=config.run.seed + ctx.world.rank,
        )
    )
    busy_s = asyncio.run(serve(ctx, pool))
    ctx.mailbox.send(RankStats("reward", busy_s, pool.failures, pool.rebuilds), 0, Tag.STATS)
    ctx.mailbox.flush()
