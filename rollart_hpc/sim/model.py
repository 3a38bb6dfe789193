"""A discrete-event model of an RL run (SimPy), driven by the controller's own bookkeeping.

The admission control, the staleness bound, the batch barrier of the sync modes and the batch assembly are
not modelled: the simulation runs the real `ControllerCore` with the simulated clock. Around it:
- env ranks, each with `envs.num_slots` episode slots, dispatched to least-loaded first as the controller
  does; a slot is taken at dispatch and freed when the result reaches the controller;
- an episode replays a measured shape (`sim.profile.EpisodeShape`, each once per shuffled pass): reset, then per turn a request to the
  rollout engine its id routes to (`routing.router`) and the env step, then the reward and messages;
- rollout engines with continuous batching: at most `rollout.num_slots` requests run, a step advances each
  by one token in `decode_s + decode_s_per_request * b` (b running), a request's prompt is prefilled in the
  step it joins;
- the trainer: one step at a time, `train_s + train_s_per_token * tokens`, then the controller publishes
  the version and the engines load it after a measured swap time;
- checkpoints every `controller.checkpoint_every_steps` steps, as the controller takes them: no batch is
  handed out while one is due, it starts once the trainer is idle, and for its measured duration the
  controller neither dispatches nor takes results (episodes that end meanwhile wait for it).
Scenario speed factors divide the measured costs of a role (2.0 = twice as fast hardware).
Projections past the calibration machine (`sim.hardware`) add:
- rollout pools with their own engine costs and task families (`PoolModel`): an episode goes to the
  least-loaded engine of a pool serving its family (every pool when none names it) and stays there;
- batch-level env interaction (`Scenario.lockstep` k): episodes are grouped by dispatch order in groups of
  k, and no member starts turn i+1 before every member still running has finished its env step of turn i;
- a reward pool (`RewardGpus`): a trajectory's reward is one request of its tokens to a reward model on
  GPUs, before its `post_s`; dedicated (a fixed number of GPUs per job) or serverless (instances started on
  demand after a cold start, shared by every job in the same SimPy environment, released after a
  keep-alive without requests; utilisation = busy time over the instances' lifetimes);
- `tokens_per_event` n: an engine advances up to n decode steps per simulated event (to the first request
  that finishes), so requests arriving meanwhile join up to n - 1 steps late (n = 1: exact).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import simpy

from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.records import Status, Trajectory
from rollart_hpc.controller.core import Batch, ControllerCore, CoreSettings
from rollart_hpc.metrics.trace import TraceWriter
from rollart_hpc.routing.router import rollout_index
from rollart_hpc.sim.profile import EpisodeShape, Profile, steady_step_s


@dataclass(frozen=True)
class PoolModel:
    """A rollout pool of `engines` engines with `slots` each and its own per-step costs (seconds)."""

    name: str
    engines: int
    slots: int
    decode_s: float
    decode_s_per_request: float
    prefill_s_per_token: float
    families: tuple[str, ...] = ()


class _Instance:
    def __init__(self, env: simpy.Environment, ready_at: float) -> None:
        self.started, self.ready_at = float(env.now), ready_at
        self.gpu = simpy.Resource(env, 1)
        self.queued = 0
        self.idle_since = ready_at


class RewardGpus:
    """Reward-model GPUs: `gpus` fixed ones, or (gpus=0) serverless instances (see the module docstring).
    A serverless request joins the warm instance with the shortest queue under `target_concurrency`, else
    starts one; an instance scores its queue one request at a time (a prefill is compute-bound, so batching
    would not shorten it)."""

    def __init__(
        self,
        s_per_token: float,
        gpus: int = 0,
        cold_start_s: float = 0.0,
        keep_alive_s: float = 0.0,
        target_concurrency: int = 100,
    ) -> None:
        self.s_per_token, self.gpus = s_per_token, gpus
        self.cold_start_s, self.keep_alive_s = cold_start_s, keep_alive_s
        self.target_concurrency = target_concurrency
        self.env: simpy.Environment | None = None
        self.busy_s = self.lifetimes_s = self.started_at = 0.0
        self.instances: list[_Instance] = []

    def bind(self, env: simpy.Environment) -> None:
        """Attach to a simulation's environment; a new environment starts the pool afresh."""
        if self.env is not env:
            self.env, self.busy_s, self.lifetimes_s, self.started_at = env, 0.0, 0.0, float(env.now)
            self.instances = [_Instance(env, float(env.now)) for _ in range(self.gpus)]

    def score(self, tokens: int) -> Generator[simpy.Event, Any, None]:
        env = self.env
        assert env is not None
        self._expire()
        open_ = [i for i in self.instances if self.gpus or i.queued < self.target_concurrency]
        if open_:
            instance = min(open_, key=lambda i: i.queued)
        else:
            instance = _Instance(env, float(env.now) + self.cold_start_s)
            self.instances.append(instance)
        instance.queued += 1
        with instance.gpu.request() as slot:
            yield slot
            if env.now < instance.ready_at:
                yield env.timeout(instance.ready_at - float(env.now))
            took = tokens * self.s_per_token
            yield env.timeout(took)
        self.busy_s += took
        instance.queued -= 1
        instance.idle_since = float(env.now)

    def _expire(self) -> None:
        if self.gpus:
            return
        assert self.env is not None
        now = float(self.env.now)
        for i in [i for i in self.instances if not i.queued and now - i.idle_since > self.keep_alive_s]:
            self.instances.remove(i)
            self.lifetimes_s += i.idle_since + self.keep_alive_s - i.started

    def utilisation(self, until: float) -> float:
        """Busy time over the GPU time held: fixed GPUs for the whole span, or the instances' lifetimes."""
        if self.gpus:
            return self.busy_s / (self.gpus * (until - self.started_at))
        self._expire()
        held = self.lifetimes_s + sum(until - i.started for i in self.instances)
        return self.busy_s / held if held > 0 else 0.0


@dataclass(frozen=True)
class Scenario:
    """The pipeline to simulate: sizes and settings from a config, hardware relative to the profile's."""

    config: Config
    rollout_speed: float = 1.0
    trainer_speed: float = 1.0
    env_speed: float = 1.0
    pools: tuple[PoolModel, ...] = ()
    lockstep: int = 0
    tokens_per_event: int = 1
    reward_pool: RewardGpus | None = None

    @property
    def num_tasks(self) -> int:
        return sum(self.config.envs.num_tasks.values())


@dataclass
class _Request:
    prompt: int
    remaining: int
    done: simpy.Event


class EngineModel:
    """A continuous-batching rollout engine (see the module docstring)."""

    def __init__(
        self,
        env: simpy.Environment,
        profile: Profile | PoolModel,
        slots: int,
        speed: float,
        tokens_per_event: int = 1,
        pool: str = "",
    ) -> None:
        self.env, self.profile, self.slots, self.speed = env, profile, slots, speed
        self.tokens_per_event, self.pool = tokens_per_event, pool
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.wake = env.event()
        self.busy_s = 0.0
        env.process(self.loop())

    def generate(self, prompt: int, tokens: int) -> simpy.Event:
        done = self.env.event()
        self.waiting.append(_Request(prompt, max(tokens, 1), done))
        if not self.wake.triggered:
            self.wake.succeed()
        return done

    def loop(self) -> Generator[simpy.Event, Any, None]:
        p = self.profile
        while True:
            if not self.running and not self.waiting:
                self.wake = self.env.event()
                yield self.wake
                continue
            prefill = 0
            while self.waiting and len(self.running) < self.slots:
                request = self.waiting.popleft()
                prefill += request.prompt
                self.running.append(request)
            b = len(self.running)
            n = min(self.tokens_per_event, min(r.remaining for r in self.running))
            dt = (
                n * (p.decode_s + p.decode_s_per_request * b) + p.prefill_s_per_token * prefill
            ) / self.speed
            yield self.env.timeout(dt)
            self.busy_s += dt
            still = []
            for request in self.running:
                request.remaining -= n
                if request.remaining:
                    still.append(request)
                else:
                    request.done.succeed()
            self.running = still


class _Lockstep:
    """A batch of episodes stepping their envs together: turn i+1 starts once every member still running
    has finished turn i (members that finished their last turn leave)."""

    def __init__(self, env: simpy.Environment, size: int) -> None:
        self.env, self.active = env, size
        self.arrived: dict[int, int] = {}
        self.events: dict[int, simpy.Event] = {}

    def arrive(self, turn: int) -> simpy.Event:
        self.arrived[turn] = self.arrived.get(turn, 0) + 1
        event = self.events.setdefault(turn, self.env.event())
        self._release()
        return event

    def leave(self) -> None:
        self.active -= 1
        self._release()

    def _release(self) -> None:
        for turn, event in self.events.items():
            if not event.triggered and self.arrived.get(turn, 0) >= self.active:
                event.succeed()


@dataclass
class Outcome:
    """What one simulated run achieved."""

    trajectories_per_s: float
    step_s: float
    wall_s: float
    trained: int
    busy: dict[str, float] = field(default_factory=dict)
    mean_llm_s: float = 0.0


class Simulation:
    """One simulated run; with `trace`, it writes the controller trace a real run would (used to check that a
    calibration recovers a known profile)."""

    def __init__(
        self,
        scenario: Scenario,
        profile: Profile,
        seed: int = 0,
        trace: TraceWriter | None = None,
        env: simpy.Environment | None = None,
    ) -> None:
        config = scenario.config
        self.scenario, self.profile = scenario, profile
        self.env = env or simpy.Environment()
        if scenario.reward_pool is not None:
            scenario.reward_pool.bind(self.env)
        self.rng = random.Random(seed)
        self.core = ControllerCore.build(
            CoreSettings.from_config(config.controller, config.algo),
            [f"task{i:06d}" for i in range(scenario.num_tasks)],
            seed,
        )
        self.core.clock = lambda: float(self.env.now)
        roles = config.roles
        n = scenario.tokens_per_event
        if scenario.pools:
            self.engines = [
                EngineModel(self.env, pool, pool.slots, scenario.rollout_speed, n, pool.name)
                for pool in scenario.pools
                for _ in range(pool.engines)
            ]
        else:
            self.engines = [
                EngineModel(self.env, profile, config.rollout.num_slots, scenario.rollout_speed, n)
                for _ in range(roles.rollout.num_ranks)
            ]
        self.lockstep: dict[int, _Lockstep] = {}
        self.dispatched = 0
        self.env_load = [0] * roles.env.num_ranks
        self.env_slots = config.envs.num_slots
        self.shapes: dict[str, EpisodeShape] = {}
        self.deck: list[EpisodeShape] = []
        self.trainer_busy = False
        self.trainer_busy_s = 0.0
        self.trained_at: list[float] = []
        self.llm_s: list[float] = []
        self.kick = self.env.event()
        self.finished = self.env.event()
        self.blocked_until = 0.0  # the controller writes a checkpoint until then
        self.last_checkpoint = 0
        self.trace = trace
        if trace is not None:
            trace.clock = lambda: float(self.env.now)
            trace.write("start", num_steps=self.core.num_steps, batch_size=self.core.batch_size)

    def next_shape(self) -> EpisodeShape:
        """The measured episodes in a shuffled order, each once per pass (drawing with replacement would
        cluster the long-tailed ones and bias short runs slow)."""
        if not self.deck:
            self.deck = list(self.profile.episodes)
            self.rng.shuffle(self.deck)
        return self.deck.pop()

    def checkpoint_due(self) -> bool:
        every = self.scenario.config.controller.checkpoint_every_steps
        version = self.core.version
        return every > 0 and version % every == 0 and version > self.last_checkpoint

    def poke(self) -> None:
        if not self.kick.triggered:
            self.kick.succeed()

    def run(self) -> Outcome:
        self.start()
        self.env.run(until=self.finished)
        return self.outcome()

    def start(self) -> None:
        self.env.process(self.controller())

    def outcome(self) -> Outcome:
        wall = self.trained_at[-1]
        busy = {
            "rollout": sum(e.busy_s for e in self.engines) / (wall * len(self.engines)),
            "trainer": self.trainer_busy_s / wall,
        }
        for pool in self.scenario.pools:
            engines = [e for e in self.engines if e.pool == pool.name]
            busy[f"pool:{pool.name}"] = sum(e.busy_s for e in engines) / (wall * len(engines))
        trained = self.core.counts["trained"]
        outcome = Outcome(trained / wall, steady_step_s(self.trained_at), wall, trained, busy)
        outcome.mean_llm_s = float(np.mean(self.llm_s)) if self.llm_s else 0.0
        return outcome

    def controller(self) -> Generator[simpy.Event, Any, None]:
        core = self.core
        while not core.done:
            while True:
                rank = min(range(len(self.env_load)), key=lambda r: (self.env_load[r], r))
                if self.env_load[rank] >= self.env_slots:
                    break
                ticket = core.dispatch()
                if ticket is None:
                    break
                self.env_load[rank] += 1
                self.env.process(self.episode(ticket.episode_id, ticket.task_id, rank))
            if self.checkpoint_due():
                if not self.trainer_busy:
                    took = self.rng.choice(self.profile.checkpoint_s)
                    self.blocked_until = float(self.env.now) + took
                    self.last_checkpoint = core.version
                    yield self.env.timeout(took)
                    continue
            elif not self.trainer_busy:
                batch = core.next_batch()
                if batch is not None:
                    self.trainer_busy = True
                    self.env.process(self.train(batch))
            self.kick = self.env.event()
            yield self.kick

    def pick_engine(self, episode_id: str, family: str) -> EngineModel:
        if not self.scenario.pools:
            return self.engines[rollout_index(episode_id, len(self.engines))]
        serving = {p.name for p in self.scenario.pools if family in p.families}
        candidates = [e for e in self.engines if e.pool in serving] or self.engines
        return min(candidates, key=lambda e: len(e.running) + len(e.waiting))

    def group_of(self) -> _Lockstep | None:
        size = self.scenario.lockstep
        if size <= 0:
            return None
        index = self.dispatched // size
        self.dispatched += 1
        return self.lockstep.setdefault(index, _Lockstep(self.env, size))

    def episode(self, episode_id: str, task_id: str, env_rank: int) -> Generator[simpy.Event, Any, None]:
        shape = self.next_shape()
        self.shapes[episode_id] = shape
        env_speed = self.scenario.env_speed
        engine = self.pick_engine(episode_id, shape.family)
        group = self.group_of()
        dispatched = float(self.env.now)
        yield self.env.timeout(shape.reset_s / env_speed)
        llm_s = []
        for turn, (prompt, gen, env_s) in enumerate(zip(shape.prompt, shape.gen, shape.env_s, strict=True)):
            asked = float(self.env.now)
            yield engine.generate(prompt, gen)
            llm_s.append(float(self.env.now) - asked)
            self.llm_s.append(llm_s[-1])
            yield self.env.timeout(env_s / env_speed)
            if group is not None:
                if turn == len(shape.gen) - 1:
                    group.leave()
                else:
                    yield group.arrive(turn)
        if self.scenario.reward_pool is not None:
            yield self.env.process(self.scenario.reward_pool.score(shape.tokens))
        yield self.env.timeout(shape.post_s)
        if self.env.now < self.blocked_until:
            yield self.env.timeout(self.blocked_until - float(self.env.now))
        reward = float(self.rng.random() < 0.5)
        status: Status = "failed" if shape.failed else "ok"
        traj = Trajectory(
            task_id=task_id, family="sim", tags=(), episode_id=episode_id, reward=reward, status=status,
            finish_cause="sim_failure" if shape.failed else "",
        )  # fmt: skip
        if self.trace is not None:
            for prompt, gen in zip(shape.prompt, shape.gen, strict=True):
                traj.action_mask += [0] * prompt + [1] * gen
            traj.token_ids = [0] * len(traj.action_mask)
            traj.llm_s, traj.env_s = llm_s, [s / env_speed for s in shape.env_s]
            traj.reset_s = shape.reset_s / env_speed
            self.trace.result(traj, dispatched)
        self.env_load[env_rank] -= 1
        self.core.on_result(traj)
        self.poke()

    def train(self, batch: Batch) -> Generator[simpy.Event, Any, None]:
        p = self.profile
        tokens = sum(self.shapes.pop(r.ticket.episode_id).tokens for r in batch.results)
        if self.trace is not None:
            self.trace.write("batch", step=batch.step, tokens=tokens)
        dt = (p.train_s + p.train_s_per_token * tokens) / self.scenario.trainer_speed
        yield self.env.timeout(dt)
        self.trainer_busy_s += dt
        self.core.on_published(batch.step + 1)
        self.trained_at.append(float(self.env.now))
        if self.trace is not None:
            self.trace.write("trained", step=batch.step)
        self.trainer_busy = False
        if self.core.done:
            self.finished.succeed()
            return
        self.env.process(self.swap(batch.step + 1))
        self.poke()

    def swap(self, version: int) -> Generator[simpy.Event, Any, None]:
        yield self.env.timeout(self.rng.choice(self.profile.swap_s))
        if version > self.core.rollout_version:
            self.core.on_rollout_version(version)
        if self.trace is not None:
            for rank in range(len(self.engines)):
                self.trace.write("loaded", rank=rank, version=version)
        self.poke()


def simulate(scenario: Scenario, profile: Profile, seeds: int = 3) -> dict[str, Any]:
    """Mean (and spread) over `seeds` simulated runs of the scenario."""
    outcomes = [Simulation(scenario, profile, seed).run() for seed in range(seeds)]
    tps = [o.trajectories_per_s for o in outcomes]
    step = [o.step_s for o in outcomes]
    return {
        "trajectories_per_s": float(np.mean(tps)),
        "trajectories_per_s_std": float(np.std(tps)),
        "step_s": float(np.mean(step)),
        "step_s_std": float(np.std(step)),
        "wall_s": float(np.mean([o.wall_s for o in outcomes])),
        "busy": {k: float(np.mean([o.busy[k] for o in outcomes])) for k in outcomes[0].busy},
        "seeds": seeds,
    }


def refine(profile: Profile, scenario: Scenario, seeds: int = 2, rounds: int = 3) -> Profile:
    """Scale the engine costs until the simulated calibration run's mean turn time matches the measured
    `profile.fit["mean_llm_s"]` (queueing and shared prefill make the per-turn fit biased at high load)."""
    target = profile.fit["mean_llm_s"]
    for _ in range(rounds):
        simulated = float(
            np.mean([Simulation(scenario, profile, seed).run().mean_llm_s for seed in range(seeds)])
        )
        if simulated <= 0:
            break
        ratio = target / simulated
        profile = replace(
            profile,
            decode_s=profile.decode_s * ratio,
            decode_s_per_request=profile.decode_s_per_request * ratio,
            prefill_s_per_token=profile.prefill_s_per_token * ratio,
            fit={**profile.fit, "refined_scale": profile.fit.get("refined_scale", 1.0) * ratio},
        )
    return profile
