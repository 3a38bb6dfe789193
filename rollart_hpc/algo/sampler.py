"""Prioritised task sampler with a per-task in-flight cap. Pure Python + numpy.

A task's weight is w = sqrt(v(1 - v)) + epsilon, with v the tracker's current baseline (SPO / SPO++; the
SPO recipe's gamma = 0 form). `acquire()` draws one task among those with fewer than
`max_in_flight_per_task` requests in flight, proportionally to w, and counts it in flight; `release()`
is called once when that request returns or is dropped.

Weights are cached per task and summed in a `SumTree` whose leaf i is task i's weight while the task is
below its cap and 0 at its cap, so a draw, a release and a refresh each cost O(log tasks), not O(tasks):
the controller dispatches at tens of thousands of requests a second over 10^5 tasks. The caller tells the
sampler when a task's value changed (`refresh(task_id)` after the tracker observes it, `refresh_all()`
after a restore; a policy event decays every task's evidence alike and changes no value). Used from one
thread (the controller's event loop). Invariants: in-flight counts never exceed the cap and never go
negative; the draw sequence is a function of the seed, the call sequence and the values read (the tree
is a function of its leaves, see `SumTree`), so a run restored from `state_dict()` (RNG state and
in-flight counts, JSON-able; the tree is derived and rebuilt) continues with the same draws as the run
that saved it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np


class ValueSource(Protocol):
    def value(self, task_id: str) -> float: ...


def priority_weight(value: float, epsilon: float) -> float:
    """w = sqrt(v(1 - v)) + epsilon: largest for tasks the policy solves half of the time.

    math.sqrt, not numpy: the same correctly rounded IEEE square root, without a numpy scalar per call
    (this runs once per returned trajectory)."""
    return math.sqrt(max(value * (1.0 - value), 0.0)) + epsilon


class SumTree:
    """Non-negative leaf weights in a complete binary tree (heap layout, node k has children 2k, 2k + 1,
    leaves at `size + i`): set one leaf, or find the leaf under a point of [0, total), in O(log n).

    Leaf i covers [sum of leaves 0..i-1, sum of leaves 0..i) in leaf order, as a cumulative sum does, so
    `find` draws the distribution of a cumulative-sum search. Every inner node is recomputed as
    left + right from its children when a leaf below it changes, never moved by a difference (as a
    Fenwick tree or running total would be): no rounding drift builds up over millions of updates, and
    each node is a function of the current leaves alone, so a tree rebuilt from the same leaves (after a
    restore) is bit for bit the tree updated leaf by leaf, and draws the same leaves. Python floats in a
    list, not a numpy array: a descent reads ~17 single elements, which numpy indexing makes slower.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        self._n = len(weights)
        self._size = 1 << max(self._n - 1, 0).bit_length()  # leaves, a power of two >= n
        self._tree: list[float] = []
        self.rebuild(weights)

    def __len__(self) -> int:
        return self._n

    def rebuild(self, weights: Sequence[float]) -> None:
        """All leaves at once, in O(n): each level is one numpy addition of the level below (the same
        IEEE additions, pairwise in the same order, as `set` does one at a time)."""
        if len(weights) != self._n:
            raise ValueError(f"SumTree of {self._n} leaves rebuilt from {len(weights)} weights")
        tree = np.zeros(2 * self._size)
        tree[self._size : self._size + self._n] = weights
        if not np.all(tree >= 0.0):  # also refuses NaN
            raise ValueError("SumTree weights must be >= 0 and not NaN")
        level = self._size
        while level > 1:
            tree[level // 2 : level] = tree[level : 2 * level : 2] + tree[level + 1 : 2 * level : 2]
            level //= 2
        self._tree = tree.tolist()

    @property
    def total(self) -> float:
        """The root, node 1 (with a single leaf, the root is that leaf)."""
        return self._tree[1]

    def leaf(self, index: int) -> float:
        return self._tree[self._size + index]

    def set(self, index: int, weight: float) -> None:
        """Set leaf `index` and recompute the sums on its path to the root from their children."""
        if not weight >= 0.0:
            raise ValueError(f"SumTree weights must be >= 0 and not NaN, got {weight}")
        tree = self._tree
        node = self._size + index
        tree[node] = total = weight
        while node > 1:  # parent = node + sibling: IEEE addition is commutative, so this is left + right
            total += tree[node ^ 1]
            node >>= 1
            tree[node] = total

    def find(self, point: float) -> int:
        """The leaf whose interval holds `point` (0 <= point <= total, total > 0), never one of weight 0.

        Left when the point is below the left child's sum, else right with the left sum subtracted; a
        point on a boundary goes right, as `searchsorted(cumsum, point, side="right")` does."""
        tree, node, size = self._tree, 1, self._size
        start = point
        while node < size:
            node += node
            left = tree[node]
            if point >= left:
                point -= left
                node += 1
        if tree[node] > 0.0:
            return node - size
        return self._find_rounded(start)

    def _find_rounded(self, point: float) -> int:
        """`find` for a point that rounding carried onto a leaf of weight 0 (probability ~1e-16 a draw).

        The subtractions can round a point up to or past the end of the right subtree's total, and
        u * total can round up to the total: this descent never enters a subtree of sum 0, so such a point
        ends on the last leaf of weight > 0 of the subtree it entered, as the old cumulative-sum draw
        stepped back to the last eligible task."""
        tree, node, size = self._tree, 1, self._size
        while node < size:
            left = tree[2 * node]
            if point < left or tree[2 * node + 1] == 0.0:
                node = 2 * node
            else:
                point -= left
                node = 2 * node + 1
        return node - size


class TaskSampler:
    """Draws task ids ∝ priority weight, skipping tasks at their in-flight cap.

    With `groups` (task i's group label, e.g. its env family) a draw first picks a group uniformly among
    those with a task below its cap, then a task of that group ∝ priority weight: each group gets an equal
    share of the draws whatever its task count. One sum tree per group; one uniform u per draw, whose
    integer part of u x (open groups) picks the group and whose fraction picks the task. Without groups
    (one group) the draw is u x total on the single tree, exactly as before groups existed.
    """

    def __init__(
        self,
        task_ids: Sequence[str],
        values: ValueSource,
        *,
        epsilon: float = 0.05,
        max_in_flight_per_task: int = 1,
        seed: int = 0,
        groups: Sequence[str] | None = None,
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
        if groups is not None and len(groups) != len(self._task_ids):
            raise ValueError(f"TaskSampler got {len(groups)} group labels for {len(self._task_ids)} tasks")
        labels = list(groups) if groups is not None else [""] * len(self._task_ids)
        names = list(dict.fromkeys(labels))  # groups in first-seen order
        self.groups = names if groups is not None else []
        self._group = [names.index(label) for label in labels] if len(names) > 1 else [0] * len(labels)
        self._members: list[list[int]] = [[] for _ in names]
        self._slot: list[int] = []  # task i's leaf in its group's tree
        for index, group in enumerate(self._group):
            self._slot.append(len(self._members[group]))
            self._members[group].append(index)
        self._weights: list[float] = [0.0] * len(self._task_ids)  # of every task, open or at its cap
        # leaf of task i in its group's tree: its weight while below its cap, else 0
        self._trees = [SumTree([0.0] * len(members)) for members in self._members]
        self._open = [len(members) for members in self._members]  # tasks below their cap, per group
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.refresh_all()

    def _is_open(self, task_id: str) -> bool:
        return self._in_flight[task_id] < self.max_in_flight_per_task

    def refresh(self, task_id: str) -> None:
        """Re-read one task's value (call after the tracker observed a result of it)."""
        index = self._index[task_id]
        weight = priority_weight(self._values.value(task_id), self.epsilon)
        if weight == self._weights[index]:
            return
        self._weights[index] = weight
        if self._is_open(task_id):
            self._trees[self._group[index]].set(self._slot[index], weight)

    def refresh_all(self) -> None:
        """Re-read every task's value (after a policy event or a restore) and rebuild the tree."""
        self._weights = [priority_weight(self._values.value(t), self.epsilon) for t in self._task_ids]
        open_ = [self._is_open(t) for t in self._task_ids]
        for group, members in enumerate(self._members):
            self._open[group] = sum(open_[i] for i in members)
            self._trees[group].rebuild([self._weights[i] if open_[i] else 0.0 for i in members])

    @property
    def task_ids(self) -> list[str]:
        return list(self._task_ids)

    def in_flight(self, task_id: str) -> int:
        return self._in_flight[task_id]

    def num_in_flight(self) -> int:
        return sum(self._in_flight.values())

    def eligible(self) -> list[str]:
        """Tasks below their in-flight cap, in registration order."""
        return [t for t in self._task_ids if self._is_open(t)]

    def weights(self, task_ids: Sequence[str]) -> np.ndarray:
        return np.array([priority_weight(self._values.value(t), self.epsilon) for t in task_ids])

    def acquire(self) -> str | None:
        """Draw one eligible task and count it in flight; None when every task is at its cap.

        One uniform u per draw, scaled to the tree's total: tasks at their cap are leaves of weight 0, so
        the task drawn is the one a cumulative sum over the eligible tasks alone, in registration order,
        would give for the same u. With groups: the open group number floor(u x k) of the k open ones (in
        first-seen order), then the same descent in its tree with the fraction u x k - floor(u x k)."""
        if len(self._trees) == 1:
            if not self._open[0]:
                return None
            group, point = 0, self._rng.random()
        else:
            open_groups = [g for g, count in enumerate(self._open) if count]
            if not open_groups:
                return None
            scaled = self._rng.random() * len(open_groups)
            pick = min(int(scaled), len(open_groups) - 1)
            group, point = open_groups[pick], scaled - pick
        tree = self._trees[group]
        index = self._members[group][tree.find(point * tree.total)]
        task_id = self._task_ids[index]
        self._in_flight[task_id] += 1
        if not self._is_open(task_id):
            tree.set(self._slot[index], 0.0)
            self._open[group] -= 1
        return task_id

    def release(self, task_id: str) -> None:
        """The request for `task_id` returned or was dropped: free its slot."""
        count = self._in_flight[task_id]
        if count <= 0:
            raise ValueError(f"release of task {task_id!r}, which has no request in flight")
        self._in_flight[task_id] = count - 1
        if count == self.max_in_flight_per_task:  # it was at its cap: its leaf gets its weight back
            index = self._index[task_id]
            group = self._group[index]
            self._trees[group].set(self._slot[index], self._weights[index])
            self._open[group] += 1

    def state_dict(self) -> dict[str, Any]:
        """JSON-able; "groups" only when the sampler has groups (the state of one without is unchanged)."""
        state: dict[str, Any] = {
            "task_ids": list(self._task_ids),
            "epsilon": self.epsilon,
            "max_in_flight_per_task": self.max_in_flight_per_task,
            "in_flight": dict(self._in_flight),
            "rng": self._rng.bit_generator.state,
        }
        if self.groups:
            state["groups"] = list(self.groups)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()` saved by a sampler with the same tasks, epsilon and cap; the tree is
        rebuilt from the restored counts and the values read now."""
        saved = (
            list(state["task_ids"]),
            float(state["epsilon"]),
            int(state["max_in_flight_per_task"]),
            list(state.get("groups", [])),
        )
        mine = (self._task_ids, self.epsilon, self.max_in_flight_per_task, self.groups)
        if saved != mine:
            raise ValueError(
                "sampler checkpoint was saved with other tasks, epsilon, in-flight cap or groups"
            )
        self._in_flight = {t: int(state["in_flight"][t]) for t in self._task_ids}
        self._rng.bit_generator.state = dict(state["rng"])
        self.refresh_all()
