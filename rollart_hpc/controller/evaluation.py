"""Evaluation rounds: the controller's bookkeeping of evaluation episodes, apart from training. No MPI.

Dataflow: `due(version)` says when a round should start (policy versions 0, k, 2k, ... with k =
`controller.eval_every_steps`, and once more at the end of a run); `start(version)` lays out the round's
tickets: every training task `eval_samples` times (sampled with the run's settings) and once greedily
when `eval_greedy`, then the held-out tasks the same way, in a fixed order with fixed seeds (ids from
`tasks.episodes`: the same (task, sample) is played with the same sampling noise in every round).
`next_ticket()` hands them out one at a time (the controller sends them to env slots shared with training);
`on_result(trajectory)` folds a finished one in and, when the round's last one is in, returns the round's
metrics row (`kind = "eval"`, `step` and `version` = the version evaluated). In async and one_step_off
modes training goes on while a round runs, so its later episodes may be played by newer weights: the row
gives the range of its tokens' versions (`eval_token_version_min/max`); in sync mode (training waits for
the round), at the end of a run and in `launch.py eval`, a round plays exactly one version.

Invariants:
1. Evaluation episodes never reach the trainer, the value tracker, the task sampler, admission control
   or the trajectory accounting of `controller.core`: the controller routes every RESULT whose episode id
   is an evaluation id here, and only here.
2. Each ticket of a round ends the round's bookkeeping once: a duplicate or unknown result (an earlier
   round's, or one left over from a stopped attempt) is counted in `ignored` and changes nothing.
3. One round at a time; a round is uniform over tasks: every task of a split contributes the same number
   of episodes, and a failed episode (crash, timeout, abort) counts as unsuccessful (and in `eval_failed`).
4. A round in flight is not checkpointed: a resumed run starts again at its checkpoint version (`resume`),
   and evaluates that version again when it is due.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollart_hpc.contracts.records import EpisodeTicket, Trajectory
from rollart_hpc.tasks.episodes import eval_episode_id, eval_round_of
from rollart_hpc.tasks.types import Task

SPLITS = ("eval", "heldout")  # training tasks, held-out tasks: metric prefixes eval_success, heldout_success


@dataclass(frozen=True)
class EvalItem:
    """One episode of a round's plan: which task, which split, greedy or sampled, which sample."""

    task_id: str
    family: str
    split: str
    greedy: bool
    sample: int


@dataclass
class EvalRound:
    version: int
    started: float
    items: dict[str, EvalItem]
    queue: list[EpisodeTicket]
    pending: set[str]
    success: dict[str, bool] = field(default_factory=dict)
    failed: int = 0
    token_versions: list[int] = field(default_factory=list)


def plan_items(train: Sequence[Task], heldout: Sequence[Task], samples: int, greedy: bool) -> list[EvalItem]:
    """The fixed episode list of every round (see the module docstring)."""
    items: list[EvalItem] = []
    for split, tasks in zip(SPLITS, (train, heldout), strict=True):
        for task in tasks:
            items.extend(EvalItem(task.id, task.family, split, False, k) for k in range(samples))
            if greedy:
                items.append(EvalItem(task.id, task.family, split, True, 0))
    return items


class Evaluator:
    """Evaluation rounds of one run or one standalone evaluation (see the module docstring)."""

    def __init__(
        self,
        train: Sequence[Task],
        heldout: Sequence[Task],
        *,
        every_steps: int,
        samples: int = 1,
        greedy: bool = False,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if samples < 1 or every_steps < 0:
            raise ValueError(f"eval samples must be >= 1 and every_steps >= 0, got {samples}, {every_steps}")
        self.items = plan_items(train, heldout, samples, greedy)
        self.every_steps, self.greedy, self.seed, self.clock = every_steps, greedy, seed, clock
        self.round: EvalRound | None = None
        self.next_due = 0  # the first version a periodic round is due at
        self.evaluated: set[int] = set()  # versions whose round was started in this attempt
        self.ignored = 0
        self.rows: list[dict[str, Any]] = []

    # ---- schedule -------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.every_steps > 0 and bool(self.items)

    @property
    def active(self) -> bool:
        return self.round is not None

    def due(self, version: int) -> bool:
        """A periodic round should start at `version` (none is running)."""
        return self.enabled and not self.active and version >= self.next_due

    def final_due(self, version: int) -> bool:
        """At the end of a run: `version` still needs its round (none is running)."""
        return self.enabled and not self.active and version not in self.evaluated

    def resume(self, version: int) -> None:
        """A run resumed at `version`: the next periodic round is at the first multiple of k from it."""
        if self.every_steps:
            self.next_due = -(-version // self.every_steps) * self.every_steps

    # ---- a round --------------------------------------------------------------------------------
    def start(self, version: int) -> int:
        """Lay out the round that evaluates `version`; returns its number of episodes."""
        if self.round is not None:
            raise RuntimeError(f"evaluation round of version {self.round.version} is still running")
        now = time.time()
        items, queue = {}, []
        for index, item in enumerate(self.items):
            episode_id = eval_episode_id(version, item.greedy, index)
            items[episode_id] = item
            queue.append(self._ticket(episode_id, item, version, now))
        self.round = EvalRound(version, self.clock(), items, queue, set(items))
        self.evaluated.add(version)
        if self.every_steps:
            self.next_due = (version // self.every_steps + 1) * self.every_steps
        return len(items)

    def _ticket(self, episode_id: str, item: EvalItem, version: int, now: float) -> EpisodeTicket:
        key = f"{self.seed}:{item.task_id}:{item.sample}:{int(item.greedy)}"
        seed = zlib.crc32(key.encode()) % (2**31)
        return EpisodeTicket(episode_id, item.task_id, version, -1, 0.0, seed, now)

    def next_ticket(self) -> EpisodeTicket | None:
        """The round's next ticket to dispatch, or None (no round, or all of it dispatched)."""
        if self.round is None or not self.round.queue:
            return None
        return self.round.queue.pop(0)

    @property
    def in_flight(self) -> int:
        """Tickets of the running round dispatched and not yet back."""
        r = self.round
        return 0 if r is None else len(r.pending) - len(r.queue)

    def on_result(self, traj: Trajectory) -> dict[str, Any] | None:
        """Fold in one evaluation episode; the round's metrics row once its last episode is in."""
        r = self.round
        if r is None or eval_round_of(traj.episode_id) != r.version or traj.episode_id not in r.pending:
            self.ignored += 1
            return None
        r.pending.discard(traj.episode_id)
        ok = traj.status == "ok"
        r.success[traj.episode_id] = ok and bool(traj.success)
        r.failed += not ok
        r.token_versions.extend(v for v, m in zip(traj.versions, traj.action_mask, strict=True) if m)
        if r.pending:
            return None
        self.round = None
        row = round_row(r, self.clock() - r.started)
        self.rows.append(row)
        return row


def round_row(r: EvalRound, seconds: float) -> dict[str, Any]:
    """The metrics row of a finished round: success per split (sampled and greedy), per family and
    overall; episodes, failures, seconds, and the range of policy versions its tokens came from."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for episode_id, item in r.items.items():
        success = r.success.get(episode_id, False)
        name = f"{item.split}_success" + ("_greedy" if item.greedy else "")
        groups[name].append(success)
        groups[f"{name}/{item.family}"].append(success)
    row: dict[str, Any] = {"kind": "eval", "step": r.version, "version": r.version}
    row.update({name: sum(values) / len(values) for name, values in sorted(groups.items())})
    row.update(eval_episodes=len(r.items), eval_failed=r.failed, eval_s=seconds)
    if r.token_versions:
        row.update(eval_token_version_min=min(r.token_versions), eval_token_version_max=max(r.token_versions))
    return row
