"""Redundant rollouts (RollArt §6.3): dispatch more episodes than a step needs, and once the buffer holds a
step's batch, end the due episodes still running (the stragglers the batch would otherwise wait for).
No MPI; `ControllerCore` owns one `Redundancy` and the controller's state sends the CANCELs.

Accounting: an aborted episode stays in flight until its trajectory comes back (failed with cause "abort",
or finished before the cancel arrived); it then ends as dropped with cause "redundant", never trained and
never folded into the tracker, and frees its admission slot. Finished due results beyond a batch (the
surplus that redundancy admits) are dropped with the same cause. Every such episode is recorded with its
task, family, status, length and reward so far (`records`), so the bias toward fast finishers is visible.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from rollart_hpc.contracts.records import EpisodeTicket, Trajectory

CAUSE = "redundant"


class Redundancy:
    """The surplus admitted beyond the staleness window, the episodes being aborted, and the records."""

    def __init__(self, batch_size: int, redundancy: float) -> None:
        if redundancy < 1.0:
            raise ValueError(f"redundancy must be >= 1, got {redundancy}")
        self.surplus = math.ceil(batch_size * redundancy - 1e-9) - batch_size
        self.aborting: set[str] = set()
        self.by_version: Counter[int] = Counter()
        self.records: list[dict[str, Any]] = []  # drained by the caller

    def mark(self, tickets: list[EpisodeTicket]) -> list[str]:
        """Mark `tickets` as being aborted; returns their episode ids."""
        for ticket in tickets:
            self.aborting.add(ticket.episode_id)
            self.by_version[ticket.version] += 1
        return [t.episode_id for t in tickets]

    def settle(self, ticket: EpisodeTicket) -> bool:
        """Whether `ticket` was being aborted (and is no longer)."""
        if ticket.episode_id not in self.aborting:
            return False
        self.aborting.discard(ticket.episode_id)
        self.by_version[ticket.version] -= 1
        if not self.by_version[ticket.version]:
            del self.by_version[ticket.version]
        return True

    def record(self, ticket: EpisodeTicket, traj: Trajectory, when: str, version: int) -> None:
        """One dropped episode: 'aborted' (a straggler) or 'surplus' (finished, beyond the batch)."""
        self.records.append(
            {
                "episode_id": ticket.episode_id,
                "task_id": ticket.task_id,
                "family": traj.family,
                "when": when,
                "status": traj.status,
                "cause": traj.failure_cause if traj.status == "failed" else "",
                "tokens": len(traj.token_ids),
                "action_tokens": int(sum(traj.action_mask)),
                "reward_so_far": float(traj.reward),
                "dispatch_version": ticket.version,
                "version": version,
            }
        )

    def take(self) -> list[dict[str, Any]]:
        records, self.records = self.records, []
        return records
