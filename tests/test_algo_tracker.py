"""SPO and SPO++ value trackers: recipe updates, Eq. 3, arrival-order invariance, checkpoints."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart_hpc.algo import (
    EventTimeTracker,
    SPORho,
    SPOTracker,
    jeffreys_prior,
    offline_priors,
    response_drift,
)


def test_jeffreys_prior_matches_recipe_formula_with_mass_8() -> None:
    alpha, beta = jeffreys_prior([1, 0, 0, 1, 1, 0, 0, 0])
    assert alpha == pytest.approx(8 * 3.5 / 9)
    assert beta == pytest.approx(8 * 5.5 / 9)
    assert alpha + beta == pytest.approx(8.0)
    assert jeffreys_prior([]) == (0.5, 0.5)
    assert sum(jeffreys_prior([1, 1], mass=4.0)) == pytest.approx(4.0)
    priors = offline_priors({"x": [1, 0], "y": []})
    assert priors == {"x": jeffreys_prior([1, 0]), "y": (0.5, 0.5)}
    assert EventTimeTracker(priors).value("x") == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        jeffreys_prior([2.0])


def test_spo_rho_is_clamped_kl_halving() -> None:
    rho = SPORho()
    assert rho(None) == 0.96  # first visit: D = 0 -> 1, clamped to 0.96
    assert rho(0.0) == 0.96
    assert rho(0.006) == pytest.approx(2 ** (-0.1))
    assert rho(0.06) == 0.875  # 0.5 clamped up to rho_min
    assert SPORho(mode="constant", constant=0.9)(5.0) == 0.9
    with pytest.raises(ValueError):
        SPORho(mode="adaptive")
    with pytest.raises(ValueError):
        rho(-0.1)


def test_spo_tracker_matches_recipe_update_on_hand_sequence() -> None:
    prior = jeffreys_prior([1, 0, 0, 0, 0, 0, 0, 0])  # (4/3, 20/3)
    tracker = SPOTracker({"t": prior})
    # (reward, drift, expected alpha, expected beta), alpha <- rho*alpha + r, beta <- rho*beta + 1 - r
    steps = [
        (1.0, None, 0.96 * 4 / 3 + 1, 0.96 * 20 / 3),  # rho 0.96: 2.28, 6.4
        (0.0, 0.06, 0.875 * 2.28, 0.875 * 6.4 + 1),  # 2^-1 clamped to 0.875: 1.995, 6.6
        (1.0, 0.01, 2 ** (-1 / 6) * 1.995 + 1, 2 ** (-1 / 6) * 6.6),  # rho 0.8909: 2.77734, 5.87993
    ]
    for reward, drift, alpha, beta in steps:
        before = tracker.dispatch("t")
        tracker.observe("t", reward, before.event, drift=drift)
        assert tracker.value("t") == pytest.approx(alpha / (alpha + beta), rel=1e-12)
        assert tracker.effective_mass("t") == pytest.approx(alpha + beta, rel=1e-12)
        assert before.baseline != tracker.value("t")
    assert tracker.value("t") == pytest.approx(2.7773429426899767 / (2.7773429426899767 + 5.87993153972624))


def test_event_time_tracker_matches_eq3_by_hand() -> None:
    tracker = EventTimeTracker({"t": (4.0, 4.0)}, rho=0.5)
    tracker.on_policy_event()
    tracker.on_policy_event()  # event 2
    tracker.observe("t", 1.0, event=1)
    # Eq. 3 at event 2: alpha = 0.25*4 + 0.5*1 = 1.5, beta = 0.25*4 = 1
    assert tracker.value("t") == pytest.approx(0.6)
    assert tracker.effective_mass("t") == pytest.approx(2.5)
    tracker.on_policy_event()  # event 3: mass halves, mean unchanged
    assert tracker.effective_mass("t") == pytest.approx(1.25)
    d = tracker.dispatch("t")
    assert (d.task_id, d.event, d.baseline) == ("t", 3, pytest.approx(0.6))
    tracker.observe("t", 0.0, event=3)
    assert tracker.value("t") == pytest.approx(0.75 / 2.25)
    assert d.baseline == pytest.approx(0.6)  # frozen at dispatch


def _eq3_value(prior: tuple[float, float], results: list[tuple[int, float]], now: int, rho: float) -> float:
    alpha = rho**now * prior[0] + math.fsum(rho ** (now - z) * r for z, r in results)
    beta = rho**now * prior[1] + math.fsum(rho ** (now - z) * (1 - r) for z, r in results)
    return alpha / (alpha + beta)


def _replay(
    results: list[tuple[str, int, float, int]], order: list[int], final_event: int
) -> EventTimeTracker:
    """Feed (task, generated event, reward, arrival event) results in `order`, advancing events as needed."""
    tracker = EventTimeTracker({"a": (2.0, 6.0), "b": (5.0, 3.0)})
    schedule = sorted(order, key=lambda i: results[i][3])  # stable: `order` decides ties
    for i in schedule:
        task, generated, reward, arrival = results[i]
        while tracker.event < arrival:
            tracker.on_policy_event()
        tracker.observe(task, reward, generated)
    while tracker.event < final_event:
        tracker.on_policy_event()
    return tracker


result_lists = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),
        st.integers(0, 6),
        st.sampled_from([0.0, 1.0, 0.25]),
        st.integers(0, 3),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(result_lists, st.randoms(use_true_random=False))
def test_event_time_baseline_does_not_depend_on_arrival_order(raw: list, rnd) -> None:  # type: ignore[no-untyped-def]
    first = [(t, z, r, z + d1) for t, z, r, d1, _ in raw]
    second = [(t, z, r, z + d2) for t, z, r, _, d2 in raw]
    final = max(a for *_, a in first + second) + 1
    order_a, order_b = list(range(len(raw))), list(range(len(raw)))
    rnd.shuffle(order_b)
    one, two = _replay(first, order_a, final), _replay(second, order_b, final)
    for task, prior in (("a", (2.0, 6.0)), ("b", (5.0, 3.0))):
        mine = [(z, r) for t, z, r, *_ in first if t == task]
        expected = _eq3_value(prior, mine, final, 0.875)
        assert one.dispatch(task).baseline == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert two.dispatch(task).baseline == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_event_time_tracker_survives_long_idle_without_nan() -> None:
    tracker = EventTimeTracker({"t": (4.0, 4.0)}, rho=0.5)
    for _ in range(3000):
        tracker.on_policy_event()
    assert tracker.value("t") == 0.5
    tracker.observe("t", 1.0, event=1000)  # weighs 0.5^2000 now: underflows if scaled to event 3000
    assert tracker.value("t") == pytest.approx(1.0)  # the prior weighs 0.5^3000, far less
    tracker.observe("t", 0.0, event=3000)
    assert tracker.value("t") == 0.0
    assert math.isfinite(tracker.effective_mass("t"))


def test_trackers_reject_bad_calls() -> None:
    tracker = EventTimeTracker({"t": (1.0, 1.0)})
    with pytest.raises(ValueError, match="current event"):
        tracker.observe("t", 1.0, event=1)
    with pytest.raises(KeyError, match="not tracked"):
        tracker.dispatch("u")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        tracker.observe("t", -0.5, event=0)
    with pytest.raises(ValueError, match="already tracked"):
        tracker.add_task("t", (1.0, 1.0))
    with pytest.raises(ValueError):
        EventTimeTracker(rho=1.5)


@pytest.mark.parametrize("make", [lambda: EventTimeTracker(rho=0.8), lambda: SPOTracker()])
def test_tracker_state_round_trips_through_json(make) -> None:  # type: ignore[no-untyped-def]
    tracker = make()
    tracker.add_task("x", jeffreys_prior([1, 1, 0]))
    tracker.add_task("y", jeffreys_prior([]))
    for step in range(5):
        tracker.observe("x", float(step % 2), tracker.event)
        tracker.on_policy_event()
    restored = make()
    restored.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    for t in (tracker, restored):
        t.observe("y", 1.0, t.event - 1)
        t.on_policy_event()
    assert restored.state_dict() == tracker.state_dict()
    assert restored.dispatch("x") == tracker.dispatch("x")


def test_tracker_checkpoint_of_other_kind_is_refused() -> None:
    state = EventTimeTracker({"t": (1.0, 1.0)}, rho=0.8).state_dict()
    with pytest.raises(ValueError, match="event_time"):
        SPOTracker().load_state_dict(state)
    with pytest.raises(ValueError, match="rho"):
        EventTimeTracker(rho=0.875).load_state_dict(state)


def test_response_drift_is_mean_absolute_logprob_change() -> None:
    assert response_drift([-1.0, -2.0], [-1.5, -1.0]) == pytest.approx(0.75)
    assert response_drift([], []) == 0.0
    with pytest.raises(ValueError):
        response_drift([0.0], [])


def test_controller_side_algo_imports_without_torch() -> None:
    code = (
        "import sys; import rollart_hpc.algo as a; a.TaskSampler; a.EventTimeTracker; a.token_normalized_advantages; "
        "assert 'torch' not in sys.modules, 'torch imported'; a.LossConfig; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
