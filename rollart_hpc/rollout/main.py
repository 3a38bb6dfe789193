"""Rollout rank of an RL run: one engine (`rollout.engine`: built-in or vLLM) serving env workers over
MPI, weights swapped in the background.

Loop: receive GENERATE/ABORT from env ranks and WEIGHTS announcements from the publishing trainer; step the
engine while it has work; send each finished output back to the env rank that asked. On WEIGHTS(v) a
background thread opens the engine's landing of v (`engine.begin_weights`) and joins the weight
broadcast, each bucket landing in the engine's staging as it comes (lone buckets straight in its
tensors; the receiver holds only the buckets in flight); the engine swaps them between two steps (no forward mixes versions; the vLLM engine pauses, loads and
resumes inside that call), after which this rank reports
LOADED(v) to the controller. Every wait is bounded: the mailbox's liveness check names a silent peer.
The engine is a `ResilientEngine` (`rollart_hpc.rollout.resilient`): a failed engine is rebuilt in place
from the newest weights (at most `rollout.max_engine_rebuilds` times), the requests it held are answered
as errors, and the rank reports its engine failures and rebuilds in its STATS. While rebuilds are
allowed, `ENGINE_FAULT_SIGNAL` (SIGRTMIN+1) fails the engine's next step (fault injection, `launch.py
chaos`); otherwise that signal keeps its default action and ends the rank.

Routing: the rank belongs to one rollout pool (`roles.rollout_pools`; engine slots and threads may be
the pool's own) and, just before each OUTPUT, sends the asking env rank a LOAD report (`RankLoad`: the
requests and tokens it holds, its engine's prefill/decode tokens and the step-time fit of
`rollout.costs.StepMeter`), which the env rank's router uses to pick the least-loaded rank of a pool and
to measure each pool's prefill and decode costs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_hpc.cluster.context import RunContext
from rollart_hpc.config.learning import TrainingConfig
from rollart_hpc.config.roles import DEFAULT_POOL, RolloutPoolConfig
from rollart_hpc.config.schema import Config, RolloutConfig
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.contracts.records import RankLoad, RankStats, Ready, WeightAnnouncement, WorkerStart
from rollart_hpc.inference.api import Engine
from rollart_hpc.inference.engines import build_engine, engine_dtype
from rollart_hpc.metrics.timeline import Timeline
from rollart_hpc.rollout.costs import CostProfile, StepMeter
from rollart_hpc.rollout.resilient import FaultInjector, ResilientEngine, arm_fault_signal

if TYPE_CHECKING:
    from rollart_hpc.weights.publisher import WeightReceiver


class _WeightThread:
    """Receives one published version off the main loop and stages it into the engine."""

    def __init__(self, receiver: WeightReceiver, engine: Engine) -> None:
        self.receiver, self.engine = receiver, engine
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, version: int) -> None:
        self.join()
        self.thread = threading.Thread(target=self._run, args=(version,), name="weights-recv", daemon=True)
        self.thread.start()

    def _run(self, version: int) -> None:
        try:
            landing = self.engine.begin_weights(version)
            try:  # each bucket lands in the engine's staging as it comes (straight in, where it can)
                direct = self.receiver.landable(landing.targets)
                got_version = self.receiver.receive(landing.land, into=direct)
                if got_version != version:
                    raise RuntimeError(f"announced weights version {version} but received {got_version}")
            except BaseException:
                landing.abort()
                raise
            landing.commit(direct)
        except BaseException as exc:  # re-raised in the main loop
            self.error = exc

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight receive failed: {self.error}") from self.error


class _Held:
    """The requests this rank holds: who asked, and how many tokens each may take (its load)."""

    def __init__(self, rank: int, pool: str, meter: StepMeter) -> None:
        self.rank, self.pool, self.meter = rank, pool, meter
        self.owners: dict[str, tuple[int, int]] = {}
        self.tokens = 0

    def add(self, request_id: str, source: int, tokens: int) -> None:
        self.owners[request_id] = (source, tokens)
        self.tokens += tokens

    def pop(self, request_id: str) -> int | None:
        entry = self.owners.pop(request_id, None)
        if entry is None:
            return None
        self.tokens -= entry[1]
        return entry[0]

    def load(self) -> RankLoad:
        m = self.meter
        return RankLoad(
            self.rank, self.pool, len(self.owners), self.tokens, m.prefill_tokens, m.decode_tokens,
            m.busy_s, m.steps, m.fit,
        )  # fmt: skip


def serve(
    ctx: RunContext,
    engine: Engine,
    receiver: WeightReceiver,
    pool: str = DEFAULT_POOL,
    meter: StepMeter | None = None,
) -> None:
    mailbox = ctx.mailbox
    meter = meter or StepMeter()
    held = _Held(ctx.world.rank, pool, meter)
    weights = _WeightThread(receiver, engine)
    reported = engine.version
    busy_s, stopping = 0.0, False
    timeline = Timeline("rollout", ctx.world.rank)
    while not stopping or engine.has_unfinished():
        for msg in mailbox.poll():
            if msg.tag == Tag.GENERATE:
                request_id, prompt, sampling = msg.payload
                held.add(request_id, msg.source, len(prompt) + sampling.max_tokens)
                engine.add_request(request_id, prompt, sampling)
            elif msg.tag == Tag.ABORT:
                engine.abort(msg.payload)
            elif msg.tag == Tag.WEIGHTS:
                announcement: WeightAnnouncement = msg.payload
                weights.start(announcement.version)
            elif msg.tag == Tag.STOP:
                stopping = True
                for request_id in list(held.owners):
                    engine.abort(request_id)
        weights.raise_error()
        if engine.has_unfinished():
            start = time.perf_counter()
            with timeline.span():
                for out in meter.run_step(engine):
                    dest = held.pop(out.request_id)
                    if dest is not None:
                        mailbox.send(held.load(), dest, Tag.LOAD)
                        mailbox.send(out, dest, Tag.OUTPUT)
            busy_s += time.perf_counter() - start
        elif engine.has_staged_weights():
            engine.step()  # an idle engine swaps staged weights at once
        else:
            time.sleep(0.0005)
        if engine.version != reported:
            reported = engine.version
            mailbox.send(reported, 0, Tag.LOADED)
        mailbox.check()
    weights.join()
    if engine.has_staged_weights():  # the last version arrived after STOP: load it, so it is reported
        engine.step()
    if engine.version != reported:
        mailbox.send(engine.version, 0, Tag.LOADED)
    timeline.write(ctx.run_dir)
    counts = (engine.failures, engine.rebuilds) if isinstance(engine, ResilientEngine) else (0, 0)
    mailbox.send(RankStats("rollout", busy_s, *counts), 0, Tag.STATS)
    mailbox.flush()


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    from rollart_hpc.weights.publisher import WeightReceiver
    from rollart_hpc.weights.transport import join_run_weight_group  # torch

    group = join_run_weight_group(ctx)  # first of all, as the first trainer does
    assert group is not None, "every rollout rank is a member of the weights group"
    import torch

    pool = rank_pool(config, ctx.world.plan.role_of(ctx.world.rank).pool)
    rollout = pool_rollout(config.rollout, pool)
    torch.set_num_threads(rollout.num_threads)
    start: WorkerStart = ctx.mailbox.wait_for(Tag.START, source=0).payload
    model_dir = Path(start.model_dir)
    receiver = WeightReceiver(group)
    seed = config.run.seed + ctx.world.rank
    dtype = engine_dtype(rollout, config.trainer.precision)
    engine = resilient_engine(rollout, config.trainer, model_dir, start.version, seed, ctx.log.warning)
    ctx.log.info(
        f"{rollout.engine} engine ready: pool {pool.name}, {rollout.num_slots} slots, {dtype}, "
        f"model {model_dir}"
    )
    ctx.mailbox.send(Ready(), 0, Tag.READY)
    meter = StepMeter(CostProfile(pool.prefill_cost_scale, pool.decode_cost_scale))
    try:
        serve(ctx, engine, receiver, pool.name, meter)
    finally:
        engine.close()


def rank_pool(config: Config, name: str) -> RolloutPoolConfig:
    """The pool config of a rank whose plan range is pool `name` ('' = the single default pool)."""
    pools = config.roles.pools()
    return next((p for p in pools if p.name == name), pools[0])


def pool_rollout(rollout: RolloutConfig, pool: RolloutPoolConfig) -> RolloutConfig:
    """The engine settings of a pool's ranks: the pool's slots and threads where it sets them."""
    return dataclasses.replace(
        rollout,
        num_slots=pool.num_slots or rollout.num_slots,
        num_threads=pool.num_threads or rollout.num_threads,
    )


def resilient_engine(
    rollout: RolloutConfig,
    trainer: TrainingConfig,
    model_dir: Path,
    version: int,
    seed: int,
    log: Callable[[str], None],
) -> ResilientEngine:
    """The rank's engine (in the dtype the trainer publishes), rebuilt from `model_dir` at `version` (then the newest weights) when
    it fails.
    Faults are injected at random steps (`rollout.fault_step_prob`) and, while rebuilds are allowed, on
    `ENGINE_FAULT_SIGNAL`."""
    faults = None
    if rollout.fault_step_prob > 0 or rollout.max_engine_rebuilds > 0:
        faults = FaultInjector(rollout.fault_step_prob, rollout.num_faults, seed)
    if faults is not None and rollout.max_engine_rebuilds > 0:
        arm_fault_signal(faults)

    def build() -> Engine:
        return build_engine(rollout, trainer, model_dir, version, seed)

    return ResilientEngine(build, rollout.max_engine_rebuilds, log, faults)
