"""Reward rank of an RL run: scores finished trajectories with the stateless per-family reward functions
(`rollart_hpc.reward`) and forwards them to the controller. Any number of reward ranks may run; env ranks
spread trajectories over them round robin."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rollart_hpc.cluster.context import RunContext
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.contracts.records import RankStats, Ready
from rollart_hpc.metrics.timeline import Timeline
from rollart_hpc.reward.pool import RewardPool


async def serve(ctx: RunContext) -> float:
    pool = RewardPool()
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
    busy_s = asyncio.run(serve(ctx))
    ctx.mailbox.send(RankStats("reward", busy_s), 0, Tag.STATS)
    ctx.mailbox.flush()
