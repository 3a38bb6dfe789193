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
   due-first (every trajectory with v0 <= n - s is in batch n, and batch n waits for in-flight ones) and
   filled oldest version first with none newer than the oldest still out (`_newest_version_taken`; no
   limit in effect when s = 1), no admitted trajectory ever falls out of the window, so nothing relies on
   discarding.
3. The baseline of a ticket is frozen at dispatch (the tracker's dispatch event), whatever the arrival order.

Redundancy (`controller.redundancy` r > 1; async, no groups): admission allows ceil(r B) - B more episodes;
once the buffer holds B results the due in-flight ones are aborted (`stragglers`, see `redundancy.py`).

Group estimator (GRPO, `group_size` G >= 2): the G tickets of a group (one task, one `group_id`) are dispatched
back to back; the group reserves G admission slots when its first ticket goes out and its version (the
staleness clock) is that ticket's v0, the oldest of the group. The sampler counts a group as one request of
its task. Once every member is back, a group with >= 2 buffered members is ready; one with fewer drops its
survivors (cause "group_incomplete") and frees its G slots. A batch is B / G ready groups, due groups
first: the arguments of invariant 2 hold with groups as the unit (B is a multiple of G).

Arrival tracker (SPO, `SPOTracker`): results are folded in arrival order with rho from SPO's drift D; the
controller holds no current-policy log-probs, so D is `drift_per_version` times the versions published
since the task's previous fold (SPO: drift since the policy last applied to the prompt); first visit D = 0.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollart_hpc.algo.sampler import TaskSampler
from rollart_hpc.algo.tracker import EventTimeTracker, SPORho, SPOTracker, ValueTracker, jeffreys_prior
from rollart_hpc.config.choices import MODE_STALENESS, Mode
from rollart_hpc.config.derive import derive
from rollart_hpc.config.learning import AlgoConfig
from rollart_hpc.config.schema import ControllerConfig
from rollart_hpc.contracts.ids import EpisodeId
from rollart_hpc.contracts.records import EpisodeTicket, Trajectory
from rollart_hpc.controller.redundancy import CAUSE as REDUNDANT
from rollart_hpc.controller.redundancy import Redundancy


@dataclass
class BufferedResult:
    ticket: EpisodeTicket
    trajectory: Trajectory
    finish_time: float


@dataclass(frozen=True)
class Batch:
    step: int
    results: list[BufferedResult]


MIN_GROUP = 2  # fewest successful members a group trains with (a group of one has no spread)


@dataclass
class Group:
    """One group of the group estimator: its task, version (v0 of its first ticket) and members."""

    task_id: str
    version: int
    members: list[str] = field(default_factory=list)  # episode ids dispatched so far
    returned: int = 0  # members back (buffered, failed or dropped)

    def to_list(self) -> list[Any]:
        return [self.task_id, self.version, list(self.members), self.returned]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> Group:
        return cls(str(data[0]), int(data[1]), [str(e) for e in data[2]], int(data[3]))


@dataclass(frozen=True)
class CoreSettings:
    """What a `ControllerCore` is built with (`ControllerCore.build`), besides its task ids and seed: the
    batch and staleness bound, the tracker ('event_time' with `rho`, or 'arrival' with `arrival_rho` and
    `drift_per_version`), the sampler, group dispatch (`group_size` >= 2) and redundancy."""

    batch_size: int
    max_staleness: int
    mode: Mode
    num_steps: int
    rho: float = 0.875
    sampler_epsilon: float = 0.05
    max_in_flight_per_task: int = 1
    tracker_kind: str = "event_time"
    arrival_rho: SPORho | None = None
    drift_per_version: float = 0.0
    group_size: int = 0
    redundancy: float = 1.0
    sampler_balance: str = "task"

    @classmethod
    def from_config(cls, controller: ControllerConfig, algo: AlgoConfig) -> CoreSettings:
        """The run's core: batches and staleness of [controller], tracker and sampler of [algo]."""
        return CORE_FROM_SECTIONS(
            controller,
            algo,
            max_staleness=controller.staleness,
            arrival_rho=SPORho(rho_min=algo.arrival_rho_min, rho_max=algo.arrival_rho_max),
            group_size=algo.group_size if algo.estimator == "group" else 0,
        )


CORE_FROM_SECTIONS = derive(
    CoreSettings,
    ControllerConfig,
    AlgoConfig,
    rename={"tracker_kind": "tracker", "drift_per_version": "arrival_drift_per_version"},
    given=("max_staleness", "arrival_rho", "group_size"),
)
"""The [controller] and [algo] fields of the same name; given: the staleness bound the mode resolves
(-1 = the mode's own), SPO's rho bounds, and the group size (0 unless the estimator is 'group')."""


class ControllerCore:
    """Admission, buffering and batch assembly for one run (see the module docstring)."""

    def __init__(
        self,
        settings: CoreSettings,
        tracker: ValueTracker,
        sampler: TaskSampler,
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        batch_size, max_staleness, mode = settings.batch_size, settings.max_staleness, settings.mode
        group_size, redundancy = settings.group_size, settings.redundancy
        if mode in MODE_STALENESS and MODE_STALENESS[mode] != max_staleness:
            raise ValueError(
                f"mode {mode!r} implies max_staleness {MODE_STALENESS[mode]}, got {max_staleness}"
            )
        if group_size and (group_size < MIN_GROUP or batch_size % group_size):
            raise ValueError(
                f"group_size {group_size} must be >= {MIN_GROUP} and divide batch_size {batch_size}"
            )
        if redundancy > 1.0 and (group_size or mode != "async"):
            raise ValueError("redundancy > 1 needs mode 'async' and no groups")
        self.batch_size, self.max_staleness, self.mode = batch_size, max_staleness, mode
        self.redundancy = Redundancy(batch_size, redundancy)
        self.last_drop_cause = ""
        self.num_steps, self.seed = settings.num_steps, seed
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
        self.group_size = group_size  # 0: no groups (tracker estimator)
        self.groups: dict[str, Group] = {}  # group id -> group, dispatched and not yet trained or dropped
        self.open_group: str | None = None  # the group whose members are being dispatched
        self.next_group = 0
        # arrival tracker: D per version since the last fold
        self.drift_per_version = settings.drift_per_version
        self.last_fold: dict[str, int] = {}  # arrival tracker: task id -> version at its last fold

    @classmethod
    def build(cls, settings: CoreSettings, task_ids: Sequence[str], seed: int) -> ControllerCore:
        """A core with a tracker (no offline outcomes: v = 0.5 per task): SPO++'s `EventTimeTracker`
        ('event_time') or SPO's `SPOTracker` ('arrival', rho from `arrival_rho`), and a `TaskSampler` over
        `task_ids`, both seeded from `seed` (`sampler_balance` 'family': the sampler's groups are the
        task ids' families, "family/rest"); `group_size` >= 2 turns on group dispatch."""
        priors = {t: jeffreys_prior([]) for t in task_ids}
        tracker: ValueTracker
        if settings.tracker_kind == "event_time":
            tracker = EventTimeTracker(priors, rho=settings.rho)
        elif settings.tracker_kind == "arrival":
            tracker = SPOTracker(priors, rho=settings.arrival_rho)
        else:
            raise ValueError(f"unknown tracker {settings.tracker_kind!r}; known: event_time, arrival")
        balance = settings.sampler_balance
        if balance not in ("task", "family"):
            raise ValueError(f"unknown sampler balance {balance!r}; known: task, family")
        families = [t.partition("/")[0] for t in task_ids] if balance == "family" else None
        sampler = TaskSampler(
            list(task_ids),
            tracker,
            epsilon=settings.sampler_epsilon,
            max_in_flight_per_task=settings.max_in_flight_per_task,
            seed=seed,
            groups=families,
        )
        return cls(settings, tracker, sampler, seed=seed)

    # ---- dispatch -------------------------------------------------------------------------------
    def admission_limit(self) -> int:
        window = min((self.rollout_version + self.max_staleness + 1), self.num_steps) * self.batch_size
        return window + self.redundancy.surplus

    def can_dispatch(self) -> bool:
        if self.admitted >= self.admission_limit():
            return False
        if self.version - self.rollout_version > self.max_staleness:
            return False  # the engines lag: a ticket of rollout_version would be stale before it starts
        batch_barrier = self.mode != "async"
        return not (batch_barrier and self.admitted % self.batch_size == 0 and self.in_flight)

    def dispatch(self) -> EpisodeTicket | None:
        """Admit one episode if the bound and the per-task in-flight caps allow it; with groups, the next
        member of the open group goes first (its slot was reserved with the group)."""
        if self.done:
            return None
        if self.open_group is not None:
            return self._issue(self.groups[self.open_group].task_id, self.open_group)
        if not self.can_dispatch():
            return None
        task_id = self.sampler.acquire()
        if task_id is None:
            return None
        if not self.group_size:
            self.admitted += 1
            return self._issue(task_id, "")
        group_id = f"g{self.next_group:08d}"
        self.next_group += 1
        self.groups[group_id] = Group(task_id, self.rollout_version)
        self.open_group = group_id
        self.admitted += self.group_size
        return self._issue(task_id, group_id)

    def _issue(self, task_id: str, group_id: str) -> EpisodeTicket:
        frozen = self.tracker.dispatch(task_id)
        index = self.next_episode
        ticket = EpisodeTicket(
            episode_id=str(EpisodeId.train(index)),
            task_id=task_id,
            version=self.rollout_version,
            event=frozen.event,
            baseline=frozen.baseline,
            seed=(self.seed * 1_000_003 + index) % (2**31),
            dispatch_time=self.clock(),
            group_id=group_id,
        )
        self.next_episode += 1
        if group_id:
            group = self.groups[group_id]
            group.members.append(ticket.episode_id)
            if len(group.members) == self.group_size:
                self.open_group = None
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
        if self.redundancy.settle(ticket):
            return self._drop_redundant(ticket, trajectory, "aborted")
        if trajectory.status == "failed":
            self.failed[trajectory.failure_cause] += 1
            if ticket.group_id:
                self._member_back(ticket.group_id)
            else:
                self.sampler.release(ticket.task_id)
                self.admitted -= 1  # frees its admission slot; nothing was learned from it
            return "failed"
        try:  # refresh before release: a task at its cap then gets its new weight in one tree update
            self._fold(ticket, trajectory.reward)
            self.sampler.refresh(ticket.task_id)
        finally:  # the slot is freed even when the tracker refuses the result
            if not ticket.group_id:
                self.sampler.release(ticket.task_id)
        outcome = "buffered"
        if self.version - ticket.version > self.max_staleness:
            self.dropped["stale"] += 1
            self.last_drop_cause = "stale"
            outcome = "dropped"
        else:
            self.buffer[trajectory.episode_id] = BufferedResult(ticket, trajectory, self.clock())
        if ticket.group_id:
            self._member_back(ticket.group_id)
        return outcome

    def _drop_redundant(self, ticket: EpisodeTicket, trajectory: Trajectory, when: str) -> str:
        """An aborted straggler came back (or a surplus result is cut): dropped, its slot freed."""
        self.redundancy.record(ticket, trajectory, when, self.version)
        self.dropped[REDUNDANT] += 1
        self.last_drop_cause = REDUNDANT
        self.admitted -= 1
        if when == "aborted":
            self.sampler.release(ticket.task_id)
        return "dropped"

    def stragglers(self) -> list[str]:
        """With redundancy, once the buffer holds a batch: the due episodes still in flight, marked as
        aborted (each is returned once); the caller cancels them."""
        if not self.redundancy.surplus or self.done or len(self.buffer) < self.batch_size:
            return []
        due = self.version - self.max_staleness
        aborting = self.redundancy.aborting
        late = [t for e, t in self.in_flight.items() if t.version <= due and e not in aborting]
        return self.redundancy.mark(late)

    def _fold(self, ticket: EpisodeTicket, reward: float) -> None:
        """Fold one outcome into the tracker; the arrival tracker gets SPO's drift (module docstring)."""
        if not isinstance(self.tracker, SPOTracker):
            self.tracker.observe(ticket.task_id, reward, ticket.event)
            return
        last = self.last_fold.get(ticket.task_id)
        drift = None if last is None else self.drift_per_version * (self.version - last)
        self.tracker.observe(ticket.task_id, reward, ticket.event, drift=drift)
        self.last_fold[ticket.task_id] = self.version

    def _member_back(self, group_id: str) -> None:
        """A member of `group_id` ended; once all are back the group is ready or dropped (docstring)."""
        group = self.groups[group_id]
        group.returned += 1
        if group.returned < self.group_size:
            return
        self.sampler.release(group.task_id)
        survivors = [e for e in group.members if e in self.buffer]
        if len(survivors) >= MIN_GROUP:
            return
        for episode_id in survivors:
            del self.buffer[episode_id]
        self.dropped["group_incomplete"] += len(survivors)
        self.admitted -= self.group_size  # frees the group's slots, as a failure frees its one
        del self.groups[group_id]

    # ---- batches --------------------------------------------------------------------------------
    def waiting_for(self) -> list[str]:
        """In-flight episodes that the next batch must include (v0 <= n - s)."""
        due = self.version - self.max_staleness
        return [e for e, t in self.in_flight.items() if t.version <= due]

    def _due_in_flight(self) -> bool:
        """Whether `waiting_for()` is non-empty (or, with groups, a due group is not back), in O(versions
        in flight) instead of O(tickets)."""
        due = self.version - self.max_staleness
        if any(g.version <= due and not self._ready(g) for g in self.groups.values()):
            return True
        aborting = self.redundancy.by_version
        return any(v <= due and n > aborting[v] for v, n in self._in_flight_by_version.items())

    def _ready(self, group: Group) -> bool:
        return group.returned == self.group_size

    def _group_batch(self) -> list[str] | None:
        """With groups: the episodes of B / G ready groups, due groups first (None to wait)."""
        due_version, wanted = self.version - self.max_staleness, self.batch_size // self.group_size
        ready = [g for g, group in self.groups.items() if self._ready(group)]
        due = [g for g in ready if self.groups[g].version <= due_version]
        if len(due) > wanted:
            raise AssertionError(f"{len(due)} due groups exceed the batch of {wanted}")
        newest = self._newest_version_taken()
        rest = sorted(
            (g for g in ready if due_version < self.groups[g].version <= newest),
            key=lambda g: self.groups[g].version,
        )
        chosen = (due + rest)[:wanted]
        if len(chosen) < wanted:
            return None
        groups = [self.groups.pop(g) for g in chosen]
        return [e for group in groups for e in group.members if e in self.buffer]

    def _newest_version_taken(self) -> float:
        """The newest dispatch version a batch may take besides its due results: the oldest version still
        out (in flight and not being aborted; with groups, of a group not yet back), or any when nothing is
        out. A batch that took a newer result while an older one was out would leave the older one to come
        due later beside a full batch (possible with s >= 2; with s = 1 every result out or buffered is of
        the newest version). Taken this way, while a result of version v <= n - s is unconsumed at step n,
        every result the earlier batches took has a version <= v, so at most B are due (admission holds at
        most (n + 1) B of versions <= n - s)."""
        if self.group_size:
            out = [g.version for g in self.groups.values() if not self._ready(g)]
        else:
            aborting = self.redundancy.by_version
            out = [v for v, n in self._in_flight_by_version.items() if n > aborting[v]]
        return min(out, default=float("inf"))

    def next_batch(self) -> Batch | None:
        """The batch of step n = self.version: due results first, then by completion; None to wait. The
        chosen results are in episode order."""
        if self.version >= self.num_steps or self.version in self.training or self._due_in_flight():
            return None
        chosen = self._group_batch() if self.group_size else self._single_batch()
        if chosen is None:
            return None
        chosen.sort()  # in episode order, not arrival order: the step's sums do not depend on timing
        results = [self.buffer.pop(e) for e in chosen]
        self.training[self.version] = chosen
        for r in results:
            self.staleness[self.version - r.ticket.version] += 1
        return Batch(self.version, results)

    def _single_batch(self) -> list[str] | None:
        """Without groups: B buffered episodes, due ones first (None to wait)."""
        if len(self.buffer) < self.batch_size:
            return None
        due_version = self.version - self.max_staleness
        newest = self._newest_version_taken()
        due = [e for e, r in self.buffer.items() if r.ticket.version <= due_version]
        rest = sorted(
            (e for e, r in self.buffer.items() if due_version < r.ticket.version <= newest),
            key=lambda e: self.buffer[e].ticket.version,
        )  # oldest version first, by completion within a version
        if len(due) > self.batch_size and self.redundancy.surplus:
            for episode_id in due[self.batch_size :]:  # the last to finish of the surplus
                result = self.buffer.pop(episode_id)
                self._drop_redundant(result.ticket, result.trajectory, "surplus")
            due = due[: self.batch_size]
        chosen = (due + rest)[: self.batch_size]
        if len(chosen) < self.batch_size:
            return None
        if len(due) > self.batch_size:
            raise AssertionError(f"{len(due)} due trajectories exceed the batch of {self.batch_size}")
        return chosen

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
        self.groups = {g: group for g, group in self.groups.items() if not self._ready(group)}
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
        (with their trajectories), the tracker and the sampler (with its RNG), the groups of the group
        estimator and the arrival tracker's last folds. Steps handed to the trainer but not yet published
        must not exist when a checkpoint is taken (see `quiescent`)."""
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
            "groups": {g: group.to_list() for g, group in self.groups.items()},
            "open_group": self.open_group,
            "next_group": self.next_group,
            "last_fold": dict(self.last_fold),
            "aborting": sorted(self.redundancy.aborting),
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
        # checkpoints written before groups and the arrival tracker existed have none of these
        self.groups = {g: Group.from_list(v) for g, v in state.get("groups", {}).items()}
        self.open_group = state.get("open_group")
        self.next_group = int(state.get("next_group", 0))
        self.last_fold = {t: int(v) for t, v in state.get("last_fold", {}).items()}
        self.redundancy.mark([self.in_flight[e] for e in state.get("aborting", ()) if e in self.in_flight])

    @property
    def quiescent(self) -> bool:
        """No step is with the trainer: the moment a checkpoint may be taken."""
        return not self.training

    def balanced(self) -> bool:
        acc = self.accounting()
        ended = acc["trained"] + sum(acc["dropped"].values()) + sum(acc["failed"].values())
        return acc["dispatched"] == ended + acc["buffered"] + acc["in_training"] + acc["in_flight"]
