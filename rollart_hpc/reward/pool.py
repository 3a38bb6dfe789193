"""An elastic reward worker pool: scores finished trajectories with the stateless reward functions, on
workers it starts under queue pressure and stops when idle (scale to zero).

Dataflow: `score(traj)` (or `score_input(inp)`, what the reward service calls) picks the function
registered for the family (or the override in `RewardPoolConfig.fn_for_family`: a name or an import
path, e.g. a `reward.functions` entry), waits for a free worker
and runs the function there; an `async` function (an LLM judge) is awaited instead, at most
`max_workers` at once. `score` writes `reward` and `success` into the trajectory; failed trajectories are
not scored (reward 0).
Workers: each worker is a one-slot executor (a thread, or a process forked from a forkserver that has
the reward functions imported). A request that finds no idle worker waits; a new worker is started (a
cold start: the process is started and warmed up, its latency recorded) when there is none, or, up to
`max_workers`, when at least `scale_up_queue` requests wait and draining them would take longer than a
cold start (moving averages of measured calls and cold starts; a call still running counts with its
time so far; before anything was measured, the queue decides, one cold start at a time).
`maybe_scale_down()` (called by its owner's loop) stops every worker idle for `idle_shutdown_s`, so an
idle pool holds no worker; the next request cold-starts one. The forkserver itself stays up (it is not
a worker: it holds no reward state and runs no reward call); it and its workers die with the pool's
process, even a SIGKILLed one (parent-death signal, `worker_boot`).
Failures: a reward call that raises is retried, up to `max_score_attempts` calls per trajectory; a worker whose
process died (`BrokenExecutor`) is dropped (`rebuilds`) and the retry runs on another. A trajectory whose
calls all failed is returned failed (cause "reward_error", reward 0), never scored by a guess. `failures`
counts failed calls. `fault_prob` injects failures (tests; seeded by `fault_seed`).
Accounting (`stats()`): cold starts and their latency, per-worker busy seconds, worker-seconds (time
workers were alive), peak workers.
Invariant: each call of `score` returns its trajectory exactly once, scored or failed with a cause; a
worker runs one call at a time and is stopped only while idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import multiprocessing
import os
import random
import time
from concurrent.futures import BrokenExecutor, Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from rollart_hpc.config.schema import check_reward_pool_fields
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.reward.functions import RewardFn, RewardInput, RewardOutput, reward_fn


@dataclass(frozen=True)
class RewardPoolConfig:
    max_workers: int = 2
    executor: Literal["thread", "process"] = "thread"
    idle_shutdown_s: float = 30.0
    scale_up_queue: int = 1
    fn_for_family: dict[str, str] = field(default_factory=dict)
    python_path: tuple[str, ...] = ()  # where the modules of import-path functions are imported from
    max_score_attempts: int = 3
    fault_prob: float = 0.0
    fault_seed: int = 0

    def __post_init__(self) -> None:
        check_reward_pool_fields(self, "reward")


class InjectedRewardError(RuntimeError):
    """A reward call failure injected by `RewardPoolConfig.fault_prob` (tests only)."""


def _warm_up() -> int:
    """Run once in a new worker: imports the reward functions so the first real call is warm."""
    from rollart_hpc.tasks.families import calc_math  # noqa: F401

    return 0


def _process_context() -> multiprocessing.context.BaseContext:
    """Workers fork from a forkserver (a fresh interpreter, never a fork of an MPI rank) that has the
    reward functions imported: a cold start costs a fork, not an interpreter start."""
    ctx = multiprocessing.get_context("forkserver")
    preload = [
        "rollart_hpc.reward.worker_boot",
        "rollart_hpc.reward.functions",
        "rollart_hpc.tasks.families.calc_math",
    ]
    ctx.set_forkserver_preload(preload)
    return ctx


def _worker_init(environ: dict[str, str], python_path: tuple[str, ...] = ()) -> None:
    """In a new process worker: die with the forkserver (which dies with the pool's owner), take the
    owner's environment of now, not the forkserver's of its start, and import from `python_path` (where
    the modules of import-path reward functions live)."""
    from rollart_hpc.cluster.lifetime import set_parent_death_signal
    from rollart_hpc.tasks.plugins import add_python_path

    set_parent_death_signal()
    if os.getppid() == 1:  # the forkserver is already gone
        os._exit(1)
    os.environ.clear()
    os.environ.update(environ)
    add_python_path(python_path)


def _average(mean: float | None, value: float, weight: float = 0.2) -> float:
    """Exponential moving average (the first value starts it)."""
    return value if mean is None else (1 - weight) * mean + weight * value


@dataclass
class _Worker:
    wid: int
    executor: Executor
    started: float
    idle_since: float
    busy: bool = False
    busy_since: float = 0.0
    busy_s: float = 0.0


class RewardPool:
    def __init__(self, cfg: RewardPoolConfig | None = None) -> None:
        self.cfg = cfg or RewardPoolConfig()
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._starting = 0
        self._waiting = 0
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sem: asyncio.Semaphore | None = None
        self._inflight = 0
        self.num_scored = 0
        self.failures = 0
        self.rebuilds = 0
        self.cold_starts = 0
        self.cold_start_s: list[float] = []
        self.peak_workers = 0
        self.busy_by_worker: dict[int, float] = {}
        self._retired_worker_s = 0.0
        self._call_s: float | None = None  # moving averages of one call and of one cold start
        self._cold_s = 0.0
        self._fault_rng = random.Random(f"reward-faults:{self.cfg.fault_seed}")

    @property
    def num_workers(self) -> int:
        """Workers alive now (0 when the pool scaled to zero)."""
        return len(self._workers)

    async def score(self, traj: Trajectory) -> Trajectory:
        if traj.status != "ok":
            traj.reward, traj.success = 0.0, False
            return traj
        errors: list[str] = []
        out = await self.score_input(RewardInput.of(traj), errors)
        if out is None:
            traj.status, traj.finish_cause = "failed", "reward_error"
            traj.error = f"scoring failed {len(errors)} times: {errors[-1]}"
            traj.reward, traj.success = 0.0, False
            return traj
        traj.reward, traj.success = float(out.reward), bool(out.success)
        return traj

    async def score_input(self, inp: RewardInput, errors: list[str] | None = None) -> RewardOutput | None:
        """The reward of one input, or None after `max_score_attempts` failed calls (each named in `errors`)."""
        errors = [] if errors is None else errors
        fn = reward_fn(self.cfg.fn_for_family.get(inp.family, inp.family), self.cfg.python_path)
        self._inflight += 1
        try:
            out = await self._call_with_retries(fn, inp, errors)
        finally:
            self._inflight -= 1
        if out is not None:
            self.num_scored += 1
        return out

    async def _call_with_retries(
        self, fn: RewardFn, inp: RewardInput, errors: list[str]
    ) -> RewardOutput | None:
        for _ in range(self.cfg.max_score_attempts):
            try:
                if self.cfg.fault_prob > 0 and self._fault_rng.random() < self.cfg.fault_prob:
                    raise InjectedRewardError("injected reward failure")
                return await self._call(fn, inp)
            except Exception as exc:  # a reward function's bug, a dead worker or a lost judge: retried
                errors.append(repr(exc))
            self.failures += 1
        return None

    async def _call(self, fn: RewardFn, inp: RewardInput) -> RewardOutput:
        if inspect.iscoroutinefunction(fn):
            self._event()
            if self._sem is None:
                self._sem = asyncio.Semaphore(self.cfg.max_workers)
            async with self._sem:
                return await fn(inp)  # type: ignore[no-any-return]
        worker = await self._acquire()
        start = time.monotonic()
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(worker.executor, fn, inp)  # type: ignore[arg-type]
        except BrokenExecutor:
            self._retire(worker, broken=True)
            raise
        finally:
            self._release(worker, time.monotonic() - start)

    # --- workers ----------------------------------------------------------------------------------------

    def _event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._changed is None or self._loop is not loop:  # a pool may outlive one event loop (tests)
            self._changed, self._loop, self._sem = asyncio.Event(), loop, None
        return self._changed

    async def _acquire(self) -> _Worker:
        """An idle worker, marked busy; starts one when the scaling rule says so, else waits."""
        self._waiting += 1
        try:
            while True:
                for worker in self._workers:
                    if not worker.busy:
                        worker.busy, worker.busy_since = True, time.monotonic()
                        return worker
                if self._should_start():
                    await self._start_worker()
                    continue
                event = self._event()
                event.clear()
                with contextlib.suppress(TimeoutError):  # re-check the rule while calls run long
                    await asyncio.wait_for(event.wait(), timeout=0.05)
        finally:
            self._waiting -= 1

    def _should_start(self) -> bool:
        """Start a worker when there is none; else when `scale_up_queue` requests wait (beyond those a
        starting worker will take) and the queue would take the workers longer to drain than a cold
        start takes (both measured; no second worker before one call and one cold start were timed)."""
        alive = len(self._workers) + self._starting
        if alive >= self.cfg.max_workers:
            return False
        if alive == 0:
            return True
        queued = self._waiting - self._starting
        if queued < self.cfg.scale_up_queue:
            return False
        if self._call_s is None or not self.cold_start_s:
            return self._starting == 0  # nothing measured yet: one cold start at a time
        now = time.monotonic()
        running = max((now - w.busy_since for w in self._workers if w.busy), default=0.0)
        return queued * max(self._call_s, running) / alive > self._cold_s

    async def _start_worker(self) -> None:
        """A cold start: build a one-slot executor and run the warm-up call in it (latency recorded)."""
        self._starting += 1
        start = time.monotonic()
        try:
            executor: Executor
            if self.cfg.executor == "process":
                executor = ProcessPoolExecutor(
                    1,
                    mp_context=_process_context(),
                    initializer=_worker_init,
                    initargs=(dict(os.environ), self.cfg.python_path),
                )
            else:
                executor = ThreadPoolExecutor(1)
            await asyncio.get_running_loop().run_in_executor(executor, _warm_up)
        finally:
            self._starting -= 1
        now = time.monotonic()
        self.cold_starts += 1
        self.cold_start_s.append(now - start)
        self._cold_s = _average(self._cold_s if self.cold_starts > 1 else None, now - start)
        self._workers.append(_Worker(next(self._ids), executor, start, now))
        self.peak_workers = max(self.peak_workers, len(self._workers))
        self._event().set()

    def _release(self, worker: _Worker, busy_s: float) -> None:
        worker.busy, worker.idle_since = False, time.monotonic()
        self._call_s = _average(self._call_s, busy_s)
        worker.busy_s += busy_s
        self.busy_by_worker[worker.wid] = worker.busy_s
        self._event().set()

    def _retire(self, worker: _Worker, broken: bool = False) -> None:
        """Stop one worker (a broken one without waiting) and count its alive seconds."""
        if worker in self._workers:
            self._workers.remove(worker)
            self._retired_worker_s += time.monotonic() - worker.started
            worker.executor.shutdown(wait=not broken, cancel_futures=broken)
            self.rebuilds += int(broken)

    async def score_many(self, trajs: list[Trajectory]) -> list[Trajectory]:
        out = list(await asyncio.gather(*(self.score(t) for t in trajs)))
        self.maybe_scale_down()
        return out

    def maybe_scale_down(self) -> int:
        """Stop every worker idle for `idle_shutdown_s`; the number stopped."""
        now = time.monotonic()
        idle = [w for w in self._workers if not w.busy and now - w.idle_since >= self.cfg.idle_shutdown_s]
        for worker in idle:
            self._retire(worker)
        return len(idle)

    def worker_seconds(self) -> float:
        """Seconds workers were alive, summed over workers (stopped ones and live ones up to now)."""
        now = time.monotonic()
        return self._retired_worker_s + sum(now - w.started for w in self._workers)

    def stats(self) -> dict[str, Any]:
        busy = sum(self.busy_by_worker.values())
        alive = self.worker_seconds()
        return {
            "scored": self.num_scored,
            "failures": self.failures,
            "rebuilds": self.rebuilds,
            "workers_now": self.num_workers,
            "peak_workers": self.peak_workers,
            "cold_starts": self.cold_starts,
            "cold_start_s_mean": sum(self.cold_start_s) / len(self.cold_start_s)
            if self.cold_start_s
            else 0.0,
            "cold_start_s_max": max(self.cold_start_s, default=0.0),
            "worker_busy_s": {str(k): round(v, 6) for k, v in self.busy_by_worker.items()},
            "busy_s": busy,
            "worker_s": alive,
            "utilisation": busy / alive if alive > 0 else 0.0,
        }

    def rank_counts(self) -> tuple[int, int]:
        """(failed reward calls, rebuilt workers), what a reward rank reports in its STATS."""
        return self.failures, self.rebuilds

    def close(self) -> None:
        for worker in list(self._workers):
            self._retire(worker)
