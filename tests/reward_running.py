"""Reward test helpers: a reward service running in the test's own event loop, stopped (and awaited) on
exit, a reward function that scores only when enough of its calls run at once, and calc_math episodes
to score."""

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from rollart_hpc.config.schema import RewardConfig
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.reward.functions import RewardInput, RewardOutput
from rollart_hpc.reward.service import RewardService
from rollart_hpc.tasks.families.calc_math import generate_problem


@asynccontextmanager
async def running_service(tmp_path: Path, cfg: RewardConfig) -> AsyncIterator[RewardService]:
    service = RewardService(cfg, tmp_path / "svc")
    task = asyncio.create_task(service.run(stats_every_s=0.2))
    try:
        yield service
    finally:
        service.stop()
        await task


def meeting_fn(num_calls: int) -> Callable[[RewardInput], RewardOutput]:
    """A reward function (reward 0.5, no success) whose calls pass only once `num_calls` of them run at
    the same time; a call waits 5 s at most."""
    barrier = threading.Barrier(num_calls, timeout=5)

    def meet(inp: RewardInput) -> RewardOutput:
        barrier.wait()
        return RewardOutput(0.5, False)

    return meet


def calc_math_traj(index: int, right: bool = True) -> Trajectory:
    """A finished calc_math episode on problem `index` that answered it right (or one off)."""
    gold = generate_problem(index).answer
    task_id = f"calc_math/{index:04d}"
    t = Trajectory(
        task_id,
        "calc_math",
        ("calc_math",),
        f"ep{index:08d}",
        actions=[f"<answer>{gold + (not right)}</answer>"],
    )
    t.finish_cause = "done"
    return t
