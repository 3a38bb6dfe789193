"""Prioritised task sampler with a per-task in-flight cap. Pure Python + numpy.

A task's weight is w = sqrt(v(1 - v)) + epsilon, with v the tracker's current baseline (SPO / SPO++; the
SPO recipe's gamma = 0 form). `acquire()` draws one task among those with fewer than
`max_in_flight_per_task` requests in flight, proportionally to w, and counts it in flight; `release()`
is called once when that request returns or is dropped.

Weights are cached in an array (a draw is O(tasks) in numpy, not in Python): the caller tells the sampler
when a task's value changed (`refresh(task_id)` after the tracker observes it, `refresh_all()` after a
restore; a policy event decays every task's evidence alike and changes no value). Used from one thread (the controller's event loop). Invariants: in-flight counts never exceed the cap
and never go negative; the draw sequence is a function of the seed, the call sequence and the values
read, so a run restored from `state_dict()` (RNG state and in-flight counts, JSON-able) continues with
the same draws as the run that saved it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np


class ValueSource(Protocol):
    def value(self, task_id: str) -> float: ...


def priority_weight(value: float, epsilon: float) -> float:
    """w = sqrt(v(1 - v)) + epsilon: largest for tasks the policy solves half of the time."""
    return float(np.sqrt(max(value * (1.0 - value), 0.0))) + epsilon


class TaskSampler:
    """Draws task ids ∝ priority weight, skipping tasks at their in-flight cap."""

    def __init__(
        self,
        task_ids: Sequence[str],
        values: ValueSource,
        *,
        epsilon: float = 0.05,
        max_in_flight_per_task: int = 1,
        seed: int = 0,
    ) -> None:
        if not task_ids:
            raise ValueError("TaskSampler needs at least one task")
        if len(set(task_ids)) != len(task_ids):
            raise ValueError("TaskSampler task ids must be unique")
        if epsilon <= 0:
            raise ValueError(f"epsilon must be > 0 so every task keeps a chance, got {epsilon}")
        if max_in_flight_per_task < 1:
            raise ValueError(f"max_in_flight_per_task must be >= 1, got {max_in_flight_per_task}")
        self._task_ids = list(task_ids)
        self._values = values
        self.epsilon = float(epsilon)
        self.max_in_flight_per_task = int(max_in_flight_per_task)
        self._in_flight: dict[str, int] = {t: 0 for t in self._task_ids}
        self._index = {t: i for i, t in enumerate(self._task_ids)}
        self._weights = np.zeros(len(self._task_ids))
        self._open = np.ones(len(self._task_ids), dtype=bool)  # below the in-flight cap
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.refresh_all()

    def refresh(self, task_id: str) -> None:
        """Re-read one task's value (call after the tracker observed a result of it)."""
        self._weights[self._index[task_id]] = priority_weight(self._values.value(task_id), self.epsilon)

    def refresh_all(self) -> None:
        """Re-read every task's value (after a policy event or a restore)."""
        self._weights[:] = self.weights(self._task_ids)

    @property
    def task_ids(self) -> list[str]:
        return list(self._task_ids)

    def in_flight(self, task_id: str) -> int:
        return self._in_flight[task_id]

    def num_in_flight(self) -> int:
        return sum(self._in_flight.values())

    def eligible(self) -> list[str]:
        """Tasks below their in-flight cap, in registration order."""
        return [t for t in self._task_ids if self._in_flight[t] < self.max_in_flight_per_task]

    def weights(self, task_ids: Sequence[str]) -> np.ndarray:
        return np.array([priority_weight(self._values.value(t), self.epsilon) for t in task_ids])

    def acquire(self) -> str | None:
        """Draw one eligible task and count it in flight; None when every task is at its cap.

        Tasks at their cap get weight 0, so the cumulative sums of the others (and the draw) are those
        of a sum over the eligible tasks alone, in registration order."""
        if not self._open.any():
            return None
        cumulative = np.cumsum(np.where(self._open, self._weights, 0.0))
        u = self._rng.random() * cumulative[-1]
        index = min(int(np.searchsorted(cumulative, u, side="right")), len(cumulative) - 1)
        while not self._open[index]:  # u landed on the end of the last eligible task's interval
            index -= 1
        task_id = self._task_ids[index]
        self._in_flight[task_id] += 1
        self._open[index] = self._in_flight[task_id] < self.max_in_flight_per_task
        return task_id

    def release(self, task_id: str) -> None:
        """The request for `task_id` returned or was dropped: free its slot."""
        if self._in_flight[task_id] <= 0:
            raise ValueError(f"release of task {task_id!r}, which has no request in flight")
        self._in_flight[task_id] -= 1
        self._open[self._index[task_id]] = True

    def state_dict(self) -> dict[str, Any]:
        return {
            "task_ids": list(self._task_ids),
            "epsilon": self.epsilon,
            "max_in_flight_per_task": self.max_in_flight_per_task,
            "in_flight": dict(self._in_flight),
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()` saved by a sampler with the same tasks, epsilon and cap."""
        saved = (list(state["task_ids"]), float(state["epsilon"]), int(state["max_in_flight_per_task"]))
        mine = (self._task_ids, self.epsilon, self.max_in_flight_per_task)
        if saved != mine:
            raise ValueError("sampler checkpoint was saved with other tasks, epsilon or in-flight cap")
        self._in_flight = {t: int(state["in_flight"][t]) for t in self._task_ids}
        self._open = np.array([self._in_flight[t] < self.max_in_flight_per_task for t in self._task_ids])
        self._rng.bit_generator.state = dict(state["rng"])
        self.refresh_all()
