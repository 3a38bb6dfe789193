"""Controller bookkeeping with plain fakes: admission, staleness, accounting.

Pins invariants 1-3 of the `rollart_hpc/controller/core.py` docstring.
"""

from collections import Counter

import pytest
from core_driving import EVENTS, finish, play, run_to_end, train_next_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart_hpc.algo.sampler import TaskSampler
from rollart_hpc.algo.tracker import EventTimeTracker
from rollart_hpc.controller.core import ControllerCore, CoreSettings

TASKS = [f"t{i}" for i in range(6)]


def make_core(mode="async", s=1, batch=3, steps=4, cap=1, seed=0, redundancy=1.0):
    tracker = EventTimeTracker({t: (0.5, 0.5) for t in TASKS})
    sampler = TaskSampler(TASKS, tracker, max_in_flight_per_task=cap, seed=seed)
    settings = CoreSettings(
        batch_size=batch, max_staleness=s, mode=mode, num_steps=steps, redundancy=redundancy
    )
    return ControllerCore(settings, tracker, sampler, seed=seed, clock=lambda: 0.0)


def test_admission_bound_and_batch_barrier_sync():
    core = make_core(mode="sync", s=0, batch=3, cap=2)
    tickets = [core.dispatch() for _ in range(5)]
    assert [t is not None for t in tickets] == [True, True, True, False, False]
    assert core.next_batch() is None  # waits for the whole batch
    for t in tickets[:3]:
        core.on_result(finish(t, 0))
    batch = core.next_batch()
    assert batch is not None and batch.step == 0 and len(batch.results) == 3
    assert core.dispatch() is None  # next batch needs the new version on every rollout engine
    core.on_published(1)
    assert core.dispatch() is None
    core.on_rollout_version(1)
    assert core.dispatch() is not None


def test_mode_staleness_must_agree():
    with pytest.raises(ValueError, match="implies max_staleness 0"):
        make_core(mode="sync", s=1)


def test_failed_frees_its_slot_and_is_counted():
    core = make_core(s=0, batch=2, cap=1)
    a, b = core.dispatch(), core.dispatch()
    assert b is not None
    assert core.dispatch() is None
    assert core.on_result(finish(a, 0, failed=True)) == "failed"
    c = core.dispatch()
    assert c is not None
    assert core.on_result(finish(a, 0)) == "ignored"  # a duplicate result is never counted twice
    assert core.accounting()["failed"] == {"crash": 1} and core.balanced()


def test_due_trajectories_are_waited_for():
    core = make_core(s=1, batch=2, steps=5, cap=1)
    t = [core.dispatch() for _ in range(4)]  # limit (0 + 1 + 1) * 2 = 4
    assert core.dispatch() is None
    for x in t[1:]:
        core.on_result(finish(x, 0))
    batch = core.next_batch()
    assert batch is not None  # step 0: nothing is due yet (v0 = 0 > 0 - 1)
    core.on_published(1)
    assert core.waiting_for() == [t[0].episode_id]
    assert core.next_batch() is None  # step 1 must include t0 (v0 = 0 = 1 - s)
    core.on_result(finish(t[0], 0))
    batch = core.next_batch()
    assert t[0].episode_id in [r.ticket.episode_id for r in batch.results]


@settings(max_examples=60, deadline=None)
@given(
    ops=EVENTS,
    s=st.integers(0, 2),
    mode=st.sampled_from(["async", "one_step_off", "sync"]),
    batch=st.integers(1, 4),
    seed=st.integers(0, 3),
)
def test_random_interleavings_keep_invariants(ops, s, mode, batch, seed):
    s = {"sync": 0, "one_step_off": 1}.get(mode, s)
    core = make_core(mode=mode, s=s, batch=batch, steps=6, cap=2, seed=seed)
    trained_at = {}
    for op, pick in ops:
        play(core, op, pick, trained_at, s)
    assert not core.dropped.get("stale")
    run_to_end(core, 200)  # liveness: finishing everything in flight always lets the run reach its last step


def test_redundancy_aborts_due_stragglers_once_a_batch_is_in():
    core = make_core(s=0, batch=2, steps=3, cap=2, redundancy=1.5)
    assert core.admission_limit() == 2 + 1
    tickets = [core.dispatch() for _ in range(3)]
    assert core.dispatch() is None
    core.on_result(finish(tickets[1], 0))
    assert core.stragglers() == []  # no batch is in yet
    core.on_result(finish(tickets[2], 0))
    assert core.stragglers() == [tickets[0].episode_id]
    assert core.stragglers() == []  # each straggler is returned once
    batch = core.next_batch()  # no longer waits for the aborted one
    assert batch is not None and [r.ticket.episode_id for r in batch.results] == [
        t.episode_id for t in tickets[1:]
    ]
    assert core.on_result(finish(tickets[0], 0, n_action=4)) == "dropped"  # done before the cancel arrived
    assert core.dropped["redundant"] == 1 and core.admitted == 2 and core.balanced()
    (record,) = core.redundancy.take()
    assert (record["episode_id"], record["when"], record["status"]) == (
        tickets[0].episode_id,
        "aborted",
        "ok",
    )
    assert record["tokens"] == 6 and record["action_tokens"] == 4 and record["reward_so_far"] == 1.0
    core.on_published(1)
    run_to_end(core, 50)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["dispatch", "finish", "fail", "batch", "rollout", "cancel"]), st.integers(0, 50)
        ),
        max_size=120,
    ),
    s=st.integers(0, 2),
    batch=st.integers(1, 4),
    redundancy=st.sampled_from([1.25, 1.5, 2.0]),
    seed=st.integers(0, 3),
)
def test_redundancy_keeps_exact_accounting(ops, s, batch, redundancy, seed):
    core = make_core(s=s, batch=batch, steps=6, cap=2, seed=seed, redundancy=redundancy)
    trained_at, ended = {}, Counter()
    for op, pick in ops:
        if op == "dispatch":
            core.dispatch()
        elif op == "cancel":
            core.stragglers()
        elif op in ("finish", "fail") and core.in_flight:
            ticket = list(core.in_flight.values())[pick % len(core.in_flight)]
            aborted = ticket.episode_id in core.redundancy.aborting
            outcome = core.on_result(finish(ticket, core.rollout_version, failed=op == "fail" or aborted))
            ended[ticket.episode_id] += 1
            assert outcome != "dropped" or aborted
        elif op == "batch":
            train_next_batch(core, trained_at, s)
        elif op == "rollout":
            core.on_rollout_version(core.version)
        assert core.balanced() and core.admitted <= core.admission_limit()
        assert core.redundancy.aborting <= set(core.in_flight)
    assert not core.dropped.get("stale") and max(ended.values(), default=1) == 1
    logged = core.redundancy.take()
    assert len(logged) == core.dropped.get("redundant", 0)
    assert not set(r["episode_id"] for r in logged) & set(trained_at)
    run_to_end(core, 200)


def test_baseline_frozen_at_dispatch():
    core = make_core(s=1, batch=2, cap=3)
    first = core.dispatch()
    frozen = first.baseline
    others = [core.dispatch() for _ in range(3)]
    for t in others:
        if t is not None and t.task_id == first.task_id:
            core.on_result(finish(t, 0, reward=1.0))
    assert first.baseline == frozen


def test_family_balance_groups_the_sampler_by_the_task_ids_family():
    from pathlib import Path

    from rollart_hpc.config import load_config
    from rollart_hpc.contracts.errors import UsageError

    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
    ids = ["household/a", "calc_math/0001", "household/b", "calc_math/0002", "calc_math/0003"]
    config = load_config(tiny, ['algo.sampler_balance="family"'])
    core = ControllerCore.build(CoreSettings.from_config(config.controller, config.algo), ids, seed=0)
    assert core.sampler.groups == ["household", "calc_math"]
    draws = Counter()
    for _ in range(3000):
        task = core.sampler.acquire()
        draws[task.partition("/")[0]] += 1
        core.sampler.release(task)
    assert abs(draws["household"] - 1500) < 6 * (3000 * 0.25) ** 0.5  # 2 tasks get half, as 3 do
    plain_config = load_config(tiny)
    plain = ControllerCore.build(
        CoreSettings.from_config(plain_config.controller, plain_config.algo), ids, seed=0
    )
    assert plain.sampler.groups == []
    with pytest.raises(UsageError, match=r"algo\.sampler_balance"):
        load_config(tiny, ['algo.sampler_balance="families"'])
    with pytest.raises(ValueError, match="unknown sampler balance 'x'"):
        settings = CoreSettings(batch_size=2, max_staleness=1, mode="async", num_steps=2, sampler_balance="x")
        ControllerCore.build(settings, ids, seed=0)


def test_bound_two_takes_no_newer_result_while_an_older_one_is_out():
    """s = 2, B = 2: a straggler of version 0 must not be left to come due at step 2 beside three other
    version-0 results because step 1 took two fresher version-1 results (the batch would overflow)."""
    core = make_core(s=2, batch=2, steps=4)
    trained: dict[str, int] = {}
    window = [core.dispatch() for _ in range(6)]  # (0 + 2 + 1) x 2 admitted at version 0
    assert all(t is not None for t in window) and core.dispatch() is None
    straggler, *others = [t for t in window if t is not None]
    for ticket in others[:2]:
        core.on_result(finish(ticket, 0))
    assert train_next_batch(core, trained, 2) is not None  # step 0
    core.on_rollout_version(1)
    fresh = list(iter(core.dispatch, None))
    assert fresh and all(t.version == 1 for t in fresh)
    for ticket in fresh:
        core.on_result(finish(ticket, 1))
    assert core.next_batch() is None  # version 0 results are still out: step 1 takes nothing newer, it waits
    for ticket in [*others[2:], straggler]:
        core.on_result(finish(ticket, 0))
    while not core.done:
        b = train_next_batch(core, trained, 2)
        assert b is not None
        core.on_rollout_version(core.version)
        for ticket in list(iter(core.dispatch, None)) + list(core.in_flight.values()):
            if ticket.episode_id in core.in_flight:
                core.on_result(finish(ticket, core.rollout_version))
    assert core.balanced() and len(trained) == 4 * 2  # train_next_batch checked every staleness


def test_no_ticket_is_dispatched_stale():
    """Engines that lag the trainer by more than s versions get no ticket: it would be stale at birth (the
    surplus of redundancy once let one through at s = 0)."""
    core = make_core(s=0, batch=1, steps=3, redundancy=1.25)
    ticket = core.dispatch()
    assert ticket is not None
    core.on_result(finish(ticket, 0))
    assert core.next_batch() is not None
    core.on_published(1)  # the trainer is at version 1, the engines still hold version 0
    assert core.admitted < core.admission_limit() and core.dispatch() is None
    core.on_rollout_version(1)
    assert core.dispatch() is not None
