"""A reward service running in the test's own event loop, stopped (and awaited) on exit."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from rollart_hpc.config.schema import RewardConfig
from rollart_hpc.reward.service import RewardService


@asynccontextmanager
async def running_service(tmp_path: Path, cfg: RewardConfig) -> AsyncIterator[RewardService]:
    service = RewardService(cfg, tmp_path / "svc")
    task = asyncio.create_task(service.run(stats_every_s=0.2))
    try:
        yield service
    finally:
        service.stop()
        await task
