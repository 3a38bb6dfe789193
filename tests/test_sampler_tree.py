"""The task sampler's sum tree: the exact draw distribution, the same draws as the cumulative-sum
sampler it replaced (so old checkpoints continue alike), and sums that never drift under updates."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart_hpc.algo.sampler import SumTree, TaskSampler, priority_weight


class FixedValues:
    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def value(self, task_id: str) -> float:
        return self.values[task_id]


class CumsumSampler:
    """The O(tasks) draw the sum tree replaced (cumulative sum + searchsorted), kept as the reference."""

    def __init__(self, task_ids: list[str], values: FixedValues, cap: int, seed: int) -> None:
        self.task_ids, self.values, self.cap = task_ids, values, cap
        self.in_flight = dict.fromkeys(task_ids, 0)
        self.weights = np.array([priority_weight(values.value(t), 0.05) for t in task_ids])
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def refresh(self, task_id: str) -> None:
        self.weights[self.task_ids.index(task_id)] = priority_weight(self.values.value(task_id), 0.05)

    def acquire(self) -> str | None:
        is_open = np.array([self.in_flight[t] < self.cap for t in self.task_ids])
        if not is_open.any():
            return None
        cumulative = np.cumsum(np.where(is_open, self.weights, 0.0))
        u = self.rng.random() * cumulative[-1]
        index = min(int(np.searchsorted(cumulative, u, side="right")), len(cumulative) - 1)
        while not is_open[index]:
            index -= 1
        self.in_flight[self.task_ids[index]] += 1
        return self.task_ids[index]

    def release(self, task_id: str) -> None:
        self.in_flight[task_id] -= 1

    def state_dict(self) -> dict:
        return {
            "task_ids": list(self.task_ids),
            "epsilon": 0.05,
            "max_in_flight_per_task": self.cap,
            "in_flight": dict(self.in_flight),
            "rng": self.rng.bit_generator.state,
        }


def random_ops(sampler, values: FixedValues, rng: random.Random, n: int) -> list[str | None]:
    """Acquire, release a random held task, or change a task's value and refresh it; returns the draws."""
    held: list[str] = []
    draws: list[str | None] = []
    for _ in range(n):
        op = rng.random()
        if op < 0.5:
            task = sampler.acquire()
            draws.append(task)
            if task is not None:
                held.append(task)
        elif op < 0.8 and held:
            sampler.release(held.pop(rng.randrange(len(held))))
        else:
            task = rng.choice(list(values.values))
            values.values[task] = rng.random()
            sampler.refresh(task)
    return draws


def chi_square_bound(dof: int, z: float = 4.75) -> float:
    """Upper tail of chi-square(dof) at the normal quantile z (Wilson-Hilferty; z = 4.75 is p ~ 1e-6)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def assert_draws_follow(sampler: TaskSampler, expected: dict[str, float], draws: int) -> None:
    """`draws` acquire + release pairs; chi-square of the counts against probabilities ∝ `expected`."""
    counts: Counter[str] = Counter()
    for _ in range(draws):
        task = sampler.acquire()
        assert task is not None and task in expected
        counts[task] += 1
        sampler.release(task)
    total = sum(expected.values())
    stat = sum((counts[t] - draws * w / total) ** 2 / (draws * w / total) for t, w in expected.items())
    assert stat < chi_square_bound(len(expected) - 1), (stat, counts)


VALUE_VECTORS = {
    "uniform": [0.5] * 8,
    "graded": [i / 15 for i in range(16)],
    "one_heavy_many_light": [0.5] + [0.0] * 30,
    "skewed": [0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.97, 0.999],
}


@pytest.mark.parametrize("name", sorted(VALUE_VECTORS))
def test_draws_match_the_exact_distribution_before_and_after_updates(name: str) -> None:
    values = FixedValues({f"t{i}": v for i, v in enumerate(VALUE_VECTORS[name])})
    sampler = TaskSampler(list(values.values), values, seed=11, max_in_flight_per_task=2)
    weights = {t: priority_weight(v, 0.05) for t, v in values.values.items()}
    assert_draws_follow(sampler, weights, 20_000)
    rng = random.Random(5)
    for task in rng.sample(list(values.values), k=len(values.values) // 2):
        values.values[task] = rng.random()
        sampler.refresh(task)
        weights[task] = priority_weight(values.values[task], 0.05)
    assert_draws_follow(sampler, weights, 20_000)
    held = [sampler.acquire(), sampler.acquire()]  # a task drawn twice reaches its cap of 2 and drops out
    at_cap = {t for t in held if t is not None and sampler.in_flight(t) == 2}
    assert_draws_follow(sampler, {t: w for t, w in weights.items() if t not in at_cap}, 10_000)


def test_same_draws_as_the_cumulative_sum_sampler() -> None:
    """Same seed, same calls: the tree maps each uniform to the task the cumulative sum did, so runs (and
    their checkpoints) draw what they drew before (up to rounding on an interval's edge, ~1e-16 a draw)."""
    for cap, seed in ((1, 0), (2, 1), (3, 2)):
        task_ids = [f"t{i}" for i in range(37)]
        start = {t: random.Random(seed * 100 + i).random() for i, t in enumerate(task_ids)}
        new_values, old_values = FixedValues(dict(start)), FixedValues(dict(start))
        new = TaskSampler(task_ids, new_values, max_in_flight_per_task=cap, seed=seed)
        old = CumsumSampler(task_ids, old_values, cap, seed)
        new_draws = random_ops(new, new_values, random.Random(seed), 4000)
        assert new_draws == random_ops(old, old_values, random.Random(seed), 4000)
        assert None in new_draws or cap > 1  # the all-at-cap case was reached


def test_checkpoint_of_the_cumulative_sum_sampler_continues_alike() -> None:
    task_ids = [f"t{i}" for i in range(20)]
    values = FixedValues({t: (i % 7) / 7 for i, t in enumerate(task_ids)})
    old = CumsumSampler(task_ids, values, cap=2, seed=4)
    for _ in range(15):
        old.acquire()
    saved = json.loads(json.dumps(old.state_dict()))
    new = TaskSampler(task_ids, values, max_in_flight_per_task=2, seed=0)
    new.load_state_dict(saved)
    assert new.state_dict() == saved
    assert [new.acquire() for _ in range(30)] == [old.acquire() for _ in range(30)]


def inner_nodes_are_sums_of_their_children(tree: SumTree) -> bool:
    nodes, size = tree._tree, tree._size
    return all(nodes[k] == nodes[2 * k] + nodes[2 * k + 1] for k in range(1, size))


leaf_weights = st.one_of(st.just(0.0), st.floats(min_value=1e-9, max_value=1e6), st.integers(0, 5).map(float))


@settings(max_examples=150, deadline=None)
@given(
    weights=st.lists(leaf_weights, min_size=1, max_size=70),
    updates=st.lists(st.tuples(st.integers(0, 10**6), leaf_weights), max_size=200),
    points=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=20),
)
def test_tree_totals_equal_leaf_sums_after_random_updates(weights, updates, points) -> None:
    tree = SumTree(weights)
    leaves = list(weights)
    for raw_index, weight in updates:
        index = raw_index % len(leaves)
        tree.set(index, weight)
        leaves[index] = weight
    assert [tree.leaf(i) for i in range(len(leaves))] == leaves
    assert inner_nodes_are_sums_of_their_children(tree)
    assert tree.total == pytest.approx(math.fsum(leaves), rel=1e-12, abs=0.0)
    rebuilt = SumTree(leaves)
    assert rebuilt._tree == tree._tree  # no drift: a function of the leaves, bit for bit
    if tree.total > 0:
        for p in points:
            assert tree.leaf(tree.find(p * tree.total)) > 0.0


def test_find_follows_searchsorted_and_skips_empty_leaves_on_rounded_points() -> None:
    tree = SumTree([1.0, 0.0, 2.0, 0.5, 0.0, 0.0])
    cumulative = np.cumsum([1.0, 0.0, 2.0, 0.5, 0.0, 0.0])
    for point in (0.0, 0.5, 1.0, 2.9, 3.0, 3.2):
        assert tree.find(point) == int(np.searchsorted(cumulative, point, side="right"))
    assert tree.find(3.5) == 3 and tree.find(4.0) == 3  # at or past the total: the last leaf with weight
    tree.set(3, 0.0)
    assert tree.find(3.0) == 2
    assert SumTree([0.25]).find(0.25) == 0


def test_tree_refuses_negative_and_nan_weights() -> None:
    with pytest.raises(ValueError):
        SumTree([1.0, -1.0])
    tree = SumTree([1.0, 2.0])
    with pytest.raises(ValueError):
        tree.set(0, float("nan"))
    with pytest.raises(ValueError):
        tree.rebuild([1.0])


@settings(max_examples=60, deadline=None)
@given(
    num_tasks=st.integers(1, 12),
    cap=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    num_groups=st.integers(0, 3),
)
def test_sampler_tree_tracks_open_weights_and_resumes_alike(num_tasks, cap, seed, num_groups) -> None:
    task_ids = [f"t{i}" for i in range(num_tasks)]
    groups = [f"g{(i * 7) % num_groups}" for i in range(num_tasks)] if num_groups else None
    values = FixedValues({t: random.Random(seed + i).random() for i, t in enumerate(task_ids)})
    sampler = TaskSampler(task_ids, values, max_in_flight_per_task=cap, seed=seed, groups=groups)
    random_ops(sampler, values, random.Random(seed), 120)
    open_weights = [
        priority_weight(values.value(t), 0.05) if sampler.in_flight(t) < cap else 0.0 for t in task_ids
    ]
    labels = groups or [""] * num_tasks
    names = list(dict.fromkeys(labels))
    assert len(sampler._trees) == len(names)
    for tree, name, open_count in zip(sampler._trees, names, sampler._open, strict=True):
        mine = [w for w, label in zip(open_weights, labels, strict=True) if label == name]
        assert [tree.leaf(i) for i in range(len(mine))] == mine
        assert tree.total == pytest.approx(math.fsum(mine), rel=1e-12, abs=0.0)
        assert open_count == sum(1 for w in mine if w > 0.0)
    assert sum(sampler._open) == len(sampler.eligible())
    restored = TaskSampler(task_ids, values, max_in_flight_per_task=cap, seed=seed + 1, groups=groups)
    restored.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert [t._tree for t in restored._trees] == [t._tree for t in sampler._trees]
    assert [restored.acquire() for _ in range(10)] == [sampler.acquire() for _ in range(10)]


GROUPED_VALUES = {"a0": 0.5, "a1": 0.1, "a2": 0.9, "a3": 0.3, "b0": 0.5, "b1": 0.02, "c0": 0.7}


def grouped_sampler(cap: int = 1, seed: int = 3) -> tuple[TaskSampler, FixedValues]:
    values = FixedValues(dict(GROUPED_VALUES))
    ids = list(values.values)
    return TaskSampler(ids, values, seed=seed, max_in_flight_per_task=cap, groups=[t[0] for t in ids]), values


def test_groups_share_draws_equally_and_tasks_within_a_group_by_weight() -> None:
    """Each of the 3 groups draws 1/3; a task gets 1/3 x its share of its group's weight."""
    sampler, values = grouped_sampler(cap=2)
    weights = {t: priority_weight(v, 0.05) for t, v in values.values.items()}
    group_total = {g: sum(w for t, w in weights.items() if t[0] == g) for g in "abc"}
    expected = {t: w / group_total[t[0]] / 3 for t, w in weights.items()}
    assert_draws_follow(sampler, expected, 30_000)
    values.values["a2"] = 0.5  # a value change moves the draws within its group only
    sampler.refresh("a2")
    weights["a2"] = priority_weight(0.5, 0.05)
    group_total["a"] = sum(w for t, w in weights.items() if t[0] == "a")
    expected = {t: w / group_total[t[0]] / 3 for t, w in weights.items()}
    assert_draws_follow(sampler, expected, 30_000)


def test_a_group_whose_tasks_are_all_at_their_cap_drops_out_until_one_returns() -> None:
    sampler, _ = grouped_sampler(cap=1)
    held = []
    while "c0" not in held:  # group c has one task: drawing it puts the whole group at its cap
        task = sampler.acquire()
        assert task is not None
        held.append(task)
    for task in held[:-1]:
        sampler.release(task)
    draws: Counter[str] = Counter()
    for _ in range(4000):
        task = sampler.acquire()
        assert task is not None and task[0] in "ab"
        draws[task[0]] += 1
        sampler.release(task)
    assert abs(draws["a"] - draws["b"]) < 6 * math.sqrt(4000 * 0.25)  # a and b still split evenly
    sampler.release("c0")
    back = Counter()
    for _ in range(3000):
        task = sampler.acquire()
        assert task is not None
        back[task[0]] += 1
        sampler.release(task)
    assert back["c"] > 3000 / 3 - 6 * math.sqrt(3000 * 2 / 9)  # c is back with its third of the draws


def test_one_group_draws_exactly_what_no_groups_draws() -> None:
    def values() -> FixedValues:
        return FixedValues({f"t{i}": i / 9 for i in range(9)})

    plain_values, grouped_values = values(), values()
    plain = TaskSampler(list(plain_values.values), plain_values, seed=4)
    grouped = TaskSampler(list(grouped_values.values), grouped_values, seed=4, groups=["household"] * 9)
    plain_draws = random_ops(plain, plain_values, random.Random(6), 300)
    assert plain_draws == random_ops(grouped, grouped_values, random.Random(6), 300)
    assert len(set(plain_draws)) > 3


def test_group_labels_are_checked_and_saved() -> None:
    values = FixedValues({"a": 0.5, "b": 0.5})
    with pytest.raises(ValueError, match="1 group labels for 2 tasks"):
        TaskSampler(["a", "b"], values, groups=["x"])
    grouped = TaskSampler(["a", "b"], values, groups=["x", "y"])
    plain = TaskSampler(["a", "b"], values)
    with pytest.raises(ValueError, match="in-flight cap or groups"):
        plain.load_state_dict(grouped.state_dict())
