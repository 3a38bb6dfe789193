"""Prioritised task sampler: weights, in-flight cap, seeding and checkpoint resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rollart_hpc.algo import EventTimeTracker, TaskSampler, priority_weight


class FixedValues:
    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def value(self, task_id: str) -> float:
        return self.values[task_id]


def test_priority_weight_formula() -> None:
    assert priority_weight(0.5, 0.05) == pytest.approx(0.55)
    assert priority_weight(0.0, 0.05) == pytest.approx(0.05)
    assert priority_weight(0.9, 0.1) == pytest.approx(0.3 + 0.1)


def test_draw_frequencies_follow_weights() -> None:
    values = {"a": 0.5, "b": 0.0, "c": 0.9}
    sampler = TaskSampler(list(values), FixedValues(values), seed=3)
    draws = 8000
    counts: Counter[str] = Counter()
    for _ in range(draws):
        task = sampler.acquire()
        assert task is not None
        counts[task] += 1
        sampler.release(task)
    total = 0.55 + 0.05 + 0.35
    for task, weight in (("a", 0.55), ("b", 0.05), ("c", 0.35)):
        assert counts[task] / draws == pytest.approx(weight / total, abs=0.02)


def test_in_flight_cap_skips_busy_tasks() -> None:
    values = {"a": 0.5, "b": 0.5, "c": 0.01}
    sampler = TaskSampler(list(values), FixedValues(values), seed=0)
    taken = [sampler.acquire() for _ in range(3)]
    assert sorted(t for t in taken if t is not None) == ["a", "b", "c"]
    assert sampler.acquire() is None
    assert sampler.num_in_flight() == 3
    sampler.release("c")
    assert sampler.acquire() == "c"
    with pytest.raises(ValueError, match="no request in flight"):
        TaskSampler(["a"], FixedValues(values)).release("a")


def test_cap_of_two_allows_two_requests_per_task() -> None:
    sampler = TaskSampler(["a", "b"], FixedValues({"a": 0.5, "b": 0.5}), max_in_flight_per_task=2, seed=1)
    taken = Counter(sampler.acquire() for _ in range(4))
    assert taken == Counter({"a": 2, "b": 2})
    assert sampler.acquire() is None


def test_same_seed_same_draws_and_resume_from_json_state() -> None:
    tracker = EventTimeTracker({f"t{i}": (1.0 + i, 8.0 - i) for i in range(8)})

    def make(seed: int) -> TaskSampler:
        return TaskSampler(list(tracker.task_ids), tracker, seed=seed, max_in_flight_per_task=2)

    def run(sampler: TaskSampler, n: int) -> list[str | None]:
        out = []
        for _ in range(n):
            task = sampler.acquire()
            out.append(task)
            if task is not None and sampler.in_flight(task) == 2:
                sampler.release(task)
        return out

    first, second = make(7), make(7)
    assert run(first, 30) == run(second, 30)
    assert run(make(8), 30) != run(make(7), 30)
    saved = json.loads(json.dumps(first.state_dict()))
    expected = run(first, 30)
    restored = make(99)
    restored.load_state_dict(saved)
    assert run(restored, 30) == expected
    assert restored.state_dict() == first.state_dict()


def test_invalid_construction_and_mismatched_checkpoint_are_refused() -> None:
    values = FixedValues({"a": 0.5, "b": 0.5})
    with pytest.raises(ValueError):
        TaskSampler([], values)
    with pytest.raises(ValueError):
        TaskSampler(["a", "a"], values)
    with pytest.raises(ValueError):
        TaskSampler(["a"], values, epsilon=0.0)
    with pytest.raises(ValueError):
        TaskSampler(["a"], values, max_in_flight_per_task=0)
    state = TaskSampler(["a", "b"], values).state_dict()
    with pytest.raises(ValueError, match="other tasks"):
        TaskSampler(["a"], values).load_state_dict(state)
