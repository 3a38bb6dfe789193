"""A reward worker pool: scores finished trajectories concurrently with the stateless reward functions.

Dataflow: `score(traj)` picks the function registered for the trajectory's family (or the override in
`RewardPoolConfig.fn_for_family`), runs it in the pool's executor (threads or processes, at most
`num_workers` at once) or awaits it if it is async (an LLM judge), and writes `reward` and `success`
into the trajectory. Failed trajectories are not scored: they keep reward 0. The executor is created
on first use and shut down by `close()` (or after the pool has been idle for `idle_shutdown_s`,
so an idle pool holds no workers); it is recreated on demand.
Invariant: each call scores exactly one trajectory once; a reward function's exception propagates to
the caller of `score` (a bug, not a score).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.reward.functions import RewardInput, RewardOutput, reward_fn


@dataclass(frozen=True)
class RewardPoolConfig:
    num_workers: int = 2
    executor: Literal["thread", "process"] = "thread"
    idle_shutdown_s: float = 30.0
    fn_for_family: dict[str, str] = field(default_factory=dict)


class RewardPool:
    def __init__(self, cfg: RewardPoolConfig | None = None) -> None:
        self.cfg = cfg or RewardPoolConfig()
        self._executor: Executor | None = None
        self._sem: asyncio.Semaphore | None = None
        self._inflight = 0
        self._idle_since = time.monotonic()
        self.num_scored = 0

    def _get_executor(self) -> Executor:
        if self._executor is None:
            kind = ProcessPoolExecutor if self.cfg.executor == "process" else ThreadPoolExecutor
            self._executor = kind(max_workers=self.cfg.num_workers)
        return self._executor

    async def score(self, traj: Trajectory) -> Trajectory:
        if traj.status != "ok":
            traj.reward, traj.success = 0.0, False
            return traj
        fn = reward_fn(self.cfg.fn_for_family.get(traj.family, traj.family))
        inp = RewardInput.of(traj)
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.cfg.num_workers)
        async with self._sem:
            self._inflight += 1
            try:
                out = await self._call(fn, inp)
            finally:
                self._inflight -= 1
                self._idle_since = time.monotonic()
        traj.reward, traj.success = float(out.reward), bool(out.success)
        self.num_scored += 1
        return traj

    async def _call(self, fn: object, inp: RewardInput) -> RewardOutput:
        if inspect.iscoroutinefunction(fn):
            return await fn(inp)  # type: ignore[no-any-return]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._get_executor(), fn, inp)  # type: ignore[arg-type]

    async def score_many(self, trajs: list[Trajectory]) -> list[Trajectory]:
        out = list(await asyncio.gather(*(self.score(t) for t in trajs)))
        self.maybe_scale_down()
        return out

    def maybe_scale_down(self) -> bool:
        """Shut the executor down if nothing ran for `idle_shutdown_s`; True if it did."""
        idle = time.monotonic() - self._idle_since
        if self._executor is not None and self._inflight == 0 and idle >= self.cfg.idle_shutdown_s:
            self.close()
            return True
        return False

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
