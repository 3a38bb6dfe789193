"""A reward worker pool: scores finished trajectories concurrently with the stateless reward functions.

Dataflow: `score(traj)` picks the function registered for the trajectory's family (or the override in
`RewardPoolConfig.fn_for_family`), runs it in the pool's executor (threads or processes, at most
`num_workers` at once) or awaits it if it is async (an LLM judge), and writes `reward` and `success`
into the trajectory. Failed trajectories are not scored: they keep reward 0. The executor is created
on first use and shut down by `close()` (or after the pool has been idle for `idle_shutdown_s`,
so an idle pool holds no workers); it is recreated on demand.
Failures: a reward call that raises is retried, up to `max_attempts` calls per trajectory; a broken
executor (a process worker died: `BrokenExecutor`) is shut down and rebuilt before the retry. A
trajectory whose calls all failed is returned failed (cause "reward_error", reward 0), never scored by
a guess. `failures` counts failed calls, `rebuilds` rebuilt executors. `fault_prob` injects failures
(tests; seeded by `fault_seed`).
Invariant: each call of `score` returns its trajectory exactly once, scored or failed with a cause.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from concurrent.futures import BrokenExecutor, Executor, ProcessPoolExecutor, ThreadPoolExecutor
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
    max_attempts: int = 3
    fault_prob: float = 0.0
    fault_seed: int = 0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or not 0.0 <= self.fault_prob < 1.0:
            raise ValueError(f"max_attempts >= 1 and 0 <= fault_prob < 1 required, got {self}")


class InjectedRewardError(RuntimeError):
    """A reward call failure injected by `RewardPoolConfig.fault_prob` (tests only)."""


class RewardPool:
    def __init__(self, cfg: RewardPoolConfig | None = None) -> None:
        self.cfg = cfg or RewardPoolConfig()
        self._executor: Executor | None = None
        self._sem: asyncio.Semaphore | None = None
        self._inflight = 0
        self._idle_since = time.monotonic()
        self.num_scored = 0
        self.failures = 0
        self.rebuilds = 0
        self._fault_rng = random.Random(f"reward-faults:{self.cfg.fault_seed}")

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
        errors: list[str] = []
        async with self._sem:
            self._inflight += 1
            try:
                out = await self._call_with_retries(fn, inp, errors)
            finally:
                self._inflight -= 1
                self._idle_since = time.monotonic()
        if out is None:
            traj.status, traj.finish_cause = "failed", "reward_error"
            traj.error = f"scoring failed {len(errors)} times: {errors[-1]}"
            traj.reward, traj.success = 0.0, False
            return traj
        traj.reward, traj.success = float(out.reward), bool(out.success)
        self.num_scored += 1
        return traj

    async def _call_with_retries(
        self, fn: object, inp: RewardInput, errors: list[str]
    ) -> RewardOutput | None:
        """The reward function's output, or None after `max_attempts` failed calls (named in `errors`)."""
        for _ in range(self.cfg.max_attempts):
            try:
                if self.cfg.fault_prob > 0 and self._fault_rng.random() < self.cfg.fault_prob:
                    raise InjectedRewardError("injected reward failure")
                return await self._call(fn, inp)
            except BrokenExecutor as exc:
                self._drop_broken_executor()
                errors.append(repr(exc))
            except Exception as exc:  # a reward function's bug or a lost judge: retried, then failed
                errors.append(repr(exc))
            self.failures += 1
        return None

    def _drop_broken_executor(self) -> None:
        """Shut a broken executor down without waiting; the next call builds a new one."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
            self.rebuilds += 1

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
