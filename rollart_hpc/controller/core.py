"""The controller's bookkeeping: dispatch with admission control, results, batches, accounting. No MPI.

Dataflow: `dispatch()` hands out an `EpisodeTicket` (episode id, task, dispatch version v0, frozen SPO++
baseline and policy event); env workers run it; `on_result(trajectory)` folds the outcome into the tracker
and the buffer; `next_batch()` returns the trajectories of the next optimizer step once they exist;
`on_published(version)` and `on_rollout_version(version)` move the versions forward.

Versions: the trainer is at version n after n optimizer steps; the batch of step n is trained at version n.
`rollout_version` is the version every rollout engine has loaded; a ticket's v0 is that version, so every
token of its trajectory was produced by a version >= v0.

Invariants (pinned by tests/test_controller_core.py):
1. Each dispatched episode ends exactly once: trained (in one batch), dropped with a cause, or failed with a
   cause. A duplicate or unknown result is counted and ignored.
2. Staleness: a trajectory trained at step n has n - v0 <= s (s = max_staleness). Admission stops
   dispatching when the admitted count would reach (rollout_version + s + 1) * B; with batches taken
   due-first (every trajectory with v0 <= n - s is in batch n, and batch n waits for in-flight ones), no
   admitted trajectory ever falls out of the window, so nothing relies on discarding.
3. The baseline of a ticket is frozen at dispatch (the tracker's dispatch event), whatever the arrival order.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollart_hpc.algo.sampler import TaskSampler
from rollart_hpc.algo.tracker import EventTimeTracker, ValueTracker, jeffreys_prior
from rollart_hpc.config.choices import MODE_STALENESS, Mode
from rollart_hpc.config.schema import AlgoConfig, ControllerConfig
from rollart_hpc.contracts.records import EpisodeTicket, Trajectory


@dataclass
class BufferedResult:
    ticket: EpisodeTicket
    trajectory: Trajectory
    finish_time: float


@dataclass(frozen=True)
class Batch:
    step: int
    results: list[BufferedResult]


class ControllerCore:
    """Admission, buffering and batch assembly for one run (see the module docstring)."""

    def __init__(
        self,
        *,
        batch_size: int,
        max_staleness: int,
        mode: Mode,
        num_steps: int,
        tracker: ValueTracker,
        sampler: TaskSampler,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if mode in MODE_STALENESS and MODE_STALENESS[mode] != max_staleness:
            raise ValueError(
                f"mode {mode!r} implies max_staleness {MODE_STALENESS[mode]}, got {max_staleness}"
            )
        self.batch_size, self.max_staleness, self.mode = batch_size, max_staleness, mode
        self.num_steps, self.seed = num_steps, seed
        self.tracker, self.sampler, self.clock = tracker, sampler, clock
        self.version = 0  # trainer version: optimizer steps completed and published
        self.rollout_version = 0
        self.next_episode = 0
        self.admitted = 0  # dispatched and not failed
        self.in_flight: dict[str, EpisodeTicket] = {}
        self._in_flight_by_version: Counter[int] = Counter()  # dispatch version -> tickets in flight
        self.buffer: OrderedDict[str, BufferedResult] = OrderedDict()
        self.training: dict[int, list[str]] = {}  # step -> episode ids handed to the trainer
        self.counts: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.staleness: Counter[int] = Counter()

    @classmethod
    def build(
        cls,
        task_ids: Sequence[str],
        *,
        batch_size: int,
        max_staleness: int,
        mode: Mode,
        num_steps: int,
        seed: int,
        rho: float = 0.875,
        sampler_epsilon: float = 0.05,
        max_in_flight_per_task: int = 1,
    ) -> ControllerCore:
        """A core with an SPO++ `EventTimeTracker` (no offline outcomes: v = 0.5 per task) and a
        `TaskSampler` over `task_ids`, both seeded from `seed`."""
        tracker = EventTimeTracker({t: jeffreys_prior([]) for t in task_ids}, rho=rho)
        sampler = TaskSampler(
            list(task_ids),
            tracker,
            epsilon=sampler_epsilon,
            max_in_flight_per_task=max_in_flight_per_task,
            seed=seed,
        )
        return cls(
            batch_size=batch_size,
            max_staleness=max_staleness,
            mode=mode,
            num_steps=num_steps,
            tracker=tracker,
            sampler=sampler,
            seed=seed,
        )

    @classmethod
    def from_config(
        cls, controller: ControllerConfig, algo: AlgoConfig, task_ids: Sequence[str], seed: int
    ) -> ControllerCore:
        return cls.build(
            task_ids,
            batch_size=controller.batch_size,
            max_staleness=controller.staleness,
            mode=controller.mode,
            num_steps=controller.num_steps,
            seed=seed,
            rho=algo.rho,
            sampler_epsilon=algo.sampler_epsilon,
            max_in_flight_per_task=algo.max_in_flight_per_task,
        )

    # ---- dispatch -------------------------------------------------------------------------------
    def admission_limit(self) -> int:
        return min((self.rollout_version + self.max_staleness + 1), self.num_steps) * self.batch_size

    def can_dispatch(self) -> bool:
        if self.admitted >= self.admission_limit():
            return False
        batch_barrier = self.mode != "async"
        return not (batch_barrier and self.admitted % self.batch_size == 0 and self.in_flight)

    def dispatch(self) -> EpisodeTicket | None:
        """Admit one episode if the bound and the per-task in-flight caps allow it."""
        if not self.can_dispatch():
            return None
        task_id = self.sampler.acquire()
        if task_id is None:
            return None
        frozen = self.tracker.dispatch(task_id)
        index = self.next_episode
        ticket = EpisodeTicket(
            episode_id=f"ep{index:08d}",
            task_id=task_id,
            version=self.rollout_version,
            event=frozen.event,
            baseline=frozen.baseline,
            seed=(self.seed * 1_000_003 + index) % (2**31),
            dispatch_time=self.clock(),
        )
        self.next_episode += 1
        self.admitted += 1
        self.in_flight[ticket.episode_id] = ticket
        self._in_flight_by_version[ticket.version] += 1
        self.counts["dispatched"] += 1
        return ticket

    # ---- results --------------------------------------------------------------------------------
    def on_result(self, trajectory: Trajectory) -> str:
        """Fold one finished episode in; returns 'buffered', 'failed', 'dropped' or 'ignored'."""
        ticket = self.in_flight.pop(trajectory.episode_id, None)
        if ticket is None:
            self.counts["ignored_unknown_or_duplicate"] += 1
            return "ignored"
        self._in_flight_by_version[ticket.version] -= 1
        if not self._in_flight_by_version[ticket.version]:
            del self._in_flight_by_version[ticket.version]
        if trajectory.status == "failed":
            self.sampler.release(ticket.task_id)
            self.admitted -= 1  # frees its admission slot; nothing was learned from it
            self.failed[trajectory.failure_cause] += 1
            return "failed"
        try:  # refresh before release: a task at its cap then gets its new weight in one tree update
            self.tracker.observe(ticket.task_id, trajectory.reward, ticket.event)
            self.sampler.refresh(ticket.task_id)
        finally:  # the slot is freed even when the tracker refuses the result
            self.sampler.release(ticket.task_id)
        if self.version - ticket.version > self.max_staleness:
            self.dropped["stale"] += 1
            return "dropped"
        self.buffer[trajectory.episode_id] = BufferedResult(ticket, trajectory, self.clock())
        return "buffered"

    # ---- batches --------------------------------------------------------------------------------
    def waiting_for(self) -> list[str]:
        """In-flight episodes that the next batch must include (v0 <= n - s)."""
        due = self.version - self.max_staleness
        return [e for e, t in self.in_flight.items() if t.version <= due]

    def _due_in_flight(self) -> bool:
        """Whether `waiting_for()` is non-empty, in O(versions in flight) instead of O(tickets)."""
        due = self.version - self.max_staleness
        return any(version <= due for version in self._in_flight_by_version)

    def next_batch(self) -> Batch | None:
        """The batch of step n = self.version: due results first, then by completion; None to wait. The
        chosen results are in episode order."""
        if self.version >= self.num_steps or self.version in self.training or self._due_in_flight():
            return None
        if len(self.buffer) < self.batch_size:
            return None
        due_version = self.version - self.max_staleness
        due = [e for e, r in self.buffer.items() if r.ticket.version <= due_version]
        rest = [e for e, r in self.buffer.items() if r.ticket.version > due_version]
        chosen = (due + rest)[: self.batch_size]
        if len(chosen) < self.batch_size:
            return None
        if len(due) > self.batch_size:
            raise AssertionError(f"{len(due)} due trajectories exceed the batch of {self.batch_size}")
        chosen.sort()  # in episode order, not arrival order: the step's sums do not depend on timing
        results = [self.buffer.pop(e) for e in chosen]
        self.training[self.version] = chosen
        for r in results:
            self.staleness[self.version - r.ticket.version] += 1
        return Batch(self.version, results)

    def on_published(self, version: int) -> None:
        """The trainer finished step version-1 and published `version`."""
        if version != self.version + 1 or (version - 1) not in self.training:
            raise ValueError(f"published version {version} does not follow step {self.version}")
        self.counts["trained"] += len(self.training.pop(version - 1))
        self.version = version
        self.tracker.on_policy_event()  # a common decay: no task's value changes, so no sampler refresh

    def on_rollout_version(self, version: int) -> None:
        if version < self.rollout_version or version > self.version:
            raise ValueError(f"rollout version {version} outside [{self.rollout_version}, {self.version}]")
        self.rollout_version = version

    # ---- end and accounting ---------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.version >= self.num_steps

    def drop_leftovers(self, cause: str = "run_end") -> list[str]:
        """At the end of a run: buffered results that no step will train are dropped with a cause."""
        ids = list(self.buffer)
        for episode_id in ids:
            del self.buffer[episode_id]
        self.dropped[cause] += len(ids)
        return ids

    def accounting(self) -> dict[str, Any]:
        """Every dispatched episode is trained, dropped, failed, buffered, in training or in flight."""
        in_training = sum(len(v) for v in self.training.values())
        return {
            "dispatched": self.counts["dispatched"],
            "trained": self.counts["trained"],
            "dropped": dict(self.dropped),
            "failed": dict(self.failed),
            "buffered": len(self.buffer),
            "in_training": in_training,
            "in_flight": len(self.in_flight),
            "ignored": self.counts["ignored_unknown_or_duplicate"],
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
        }

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run: versions, counters, tickets in flight, buffered results
        (with their trajectories), the tracker and the sampler (with its RNG). Steps handed to the trainer
        but not yet published must not exist when a checkpoint is taken (see `quiescent`)."""
        if self.training:
            raise RuntimeError(f"checkpoint while steps {sorted(self.training)} are being trained")
        return {
            "version": self.version,
            "next_episode": self.next_episode,
            "admitted": self.admitted,
            "in_flight": [t.to_dict() for t in self.in_flight.values()],
            "buffer": [
                (r.ticket.to_dict(), r.trajectory.to_dict(), r.finish_time) for r in self.buffer.values()
            ],
            "counts": dict(self.counts),
            "dropped": dict(self.dropped),
            "failed": dict(self.failed),
            "staleness": dict(self.staleness),
            "tracker": self.tracker.state_dict(),
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`; rollout engines restart at `version`, tickets in flight are kept so
        that the caller dispatches them again (`in_flight`) and none is counted twice."""
        self.version = self.rollout_version = int(state["version"])
        self.next_episode, self.admitted = int(state["next_episode"]), int(state["admitted"])
        self.in_flight = {t["episode_id"]: EpisodeTicket.from_dict(t) for t in state["in_flight"]}
        self._in_flight_by_version = Counter(t.version for t in self.in_flight.values())
        self.buffer = OrderedDict(
            (t["episode_id"], BufferedResult(EpisodeTicket.from_dict(t), Trajectory.from_dict(traj), finish))
            for t, traj, finish in state["buffer"]
        )
        self.training = {}
        self.counts, self.dropped = Counter(state["counts"]), Counter(state["dropped"])
        self.failed, self.staleness = Counter(state["failed"]), Counter(state["staleness"])
        self.tracker.load_state_dict(state["tracker"])
        self.sampler.load_state_dict(state["sampler"])
        self.sampler.refresh_all()

    @property
    def quiescent(self) -> bool:
        """No step is with the trainer: the moment a checkpoint may be taken."""
        return not self.training

    def balanced(self) -> bool:
        acc = self.accounting()
        ended = acc["trained"] + sum(acc["dropped"].values()) + sum(acc["failed"].values())
        return acc["dispatched"] == ended + acc["buffered"] + acc["in_training"] + acc["in_flight"]
