"""The algorithm arms of the SPO++ experiments, selected by config: presets, the arrival tracker in the
controller, group dispatch with a group barrier, GRPO / Dr. GRPO advantages, accounting and checkpoints."""

import json
import math

import numpy as np
import pytest
from core_driving import EVENTS, finish, play, run_to_end
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart_hpc.algo.advantages import grpo_advantages, token_normalized_advantages
from rollart_hpc.algo.tracker import EventTimeTracker, SPORho, SPOTracker
from rollart_hpc.config.learning import AlgoConfig
from rollart_hpc.config.loader import build, to_dict
from rollart_hpc.config.schema import Config, ControllerConfig
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.records import EpisodeTicket
from rollart_hpc.controller.batching import batch_advantages
from rollart_hpc.controller.core import ControllerCore, CoreSettings

TASKS = [f"t{i}" for i in range(6)]


def make_core(algo: AlgoConfig, mode="async", batch=4, steps=4, seed=0, tasks=TASKS) -> ControllerCore:
    controller = ControllerConfig(mode=mode, batch_size=batch, num_steps=steps)
    core = ControllerCore.build(CoreSettings.from_config(controller, algo), tasks, seed)
    core.clock = lambda: 0.0
    return core


def build_config(algo: dict, batch_size: int = 4) -> Config:
    return build(Config, {"run": {"job": "rl"}, "algo": algo, "controller": {"batch_size": batch_size}})


# ---- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("spo++", ("event_time", "action_token", "tracker", 0, "")),
        ("spo", ("arrival", "trajectory", "tracker", 0, "")),
        ("grpo", ("event_time", "", "group", 4, "grpo")),
        ("dr_grpo", ("event_time", "", "group", 4, "dr_grpo")),
        ("rloo", ("event_time", "", "group", 4, "rloo")),
        ("reinforce++", ("event_time", "", "batch", 0, "")),
        ("gspo", ("event_time", "", "group", 4, "grpo")),
        ("custom", ("event_time", "action_token", "tracker", 0, "")),
    ],
)
def test_presets_fill_their_fields(name, fields):
    algo = build_config({"name": name}).algo
    assert (algo.tracker, algo.normalization, algo.estimator, algo.group_size, algo.group_advantage) == fields


@pytest.mark.parametrize(
    ("name", "loss"),
    [
        ("spo++", ("token_mean", 0, "token", 0.2, 0.28)),
        ("dr_grpo", ("seq_mean_token_sum_norm", 1024, "token", 0.2, 0.28)),
        ("rloo", ("token_mean", 0, "token", 0.2, 0.28)),
        ("reinforce++", ("token_mean", 0, "token", 0.2, 0.28)),
        ("gspo", ("seq_mean_token_mean", 0, "sequence", 3e-4, 4e-4)),
    ],
)
def test_presets_fill_their_loss(name, loss):
    """Dr. GRPO's constant defaults to rollout.max_model_len (1024 by default); GSPO's clip range is overridable."""
    algo = build_config({"name": name}).algo
    assert (algo.loss_agg, algo.loss_agg_tokens, algo.ratio_level, algo.clip_low, algo.clip_high) == loss
    assert build_config({"name": "gspo", "clip_high": 1e-3}).algo.clip_high == 1e-3
    assert build_config({"name": "dr_grpo", "loss_agg_tokens": 64}).algo.loss_agg_tokens == 64


def test_loss_config_from_the_algo_section():
    from rollart_hpc.algo.loss import loss_config

    algo = build_config({"name": "custom", "dual_clip_c": 0, "is_cap": 3.0, "is_reject_high": 4.0}).algo
    cfg = loss_config(algo)
    assert (cfg.dual_clip_c, cfg.is_cap, cfg.is_reject_low, cfg.is_reject_high) == (None, 3.0, None, 4.0)
    algo = build_config({"kl_coef": 0.01}).algo
    assert (algo.kl_estimator, algo.kl_in) == ("k3", "loss")  # the resolved file states them
    kl = loss_config(algo)
    assert (kl.kl_coef, kl.kl_estimator, kl.kl_in) == (0.01, "k3", "loss")
    gspo = loss_config(build_config({"name": "gspo"}).algo)
    assert (gspo.ratio_level, gspo.loss_agg, gspo.clip_low) == ("sequence", "seq_mean_token_mean", 3e-4)


def test_default_is_spo_plus_plus_and_fields_agreeing_with_the_preset_are_accepted():
    assert AlgoConfig() == AlgoConfig(name="spo++", tracker="event_time", normalization="action_token")
    algo = build_config({"name": "grpo", "group_size": 2, "estimator": "group"}).algo
    assert algo.group_size == 2 and algo.group_advantage == "grpo"


def test_custom_combines_arms():
    algo = build_config({"name": "custom", "tracker": "arrival", "normalization": "action_token"}).algo
    assert (algo.tracker, algo.normalization, algo.estimator) == ("arrival", "action_token", "tracker")
    algo = build_config({"name": "custom", "estimator": "group", "tracker": "arrival"}).algo
    assert (algo.group_size, algo.group_advantage) == (4, "grpo")


def test_resolved_algo_round_trips():
    """The resolved file holds the filled fields; reading it back gives the same arm."""
    for name in ("spo++", "spo", "grpo", "dr_grpo", "rloo", "reinforce++", "gspo"):
        algo = build_config({"name": name}).algo
        assert build(AlgoConfig, to_dict(algo), "algo") == algo


def test_legacy_advantage_maps_onto_normalization():
    assert AlgoConfig(advantage="spo++").normalization == "action_token"
    algo = AlgoConfig(name="custom", advantage="spo")
    assert (algo.normalization, algo.tracker) == ("trajectory", "event_time")  # what 'spo' meant before
    assert AlgoConfig(name="spo", advantage="spo").tracker == "arrival"


@pytest.mark.parametrize(
    ("algo", "batch", "needle"),
    [
        ({"name": "spo", "tracker": "event_time"}, 4, "algo.tracker: 'event_time' conflicts with algo.name"),
        ({"name": "grpo", "estimator": "tracker"}, 4, "algo.estimator: 'tracker' conflicts"),
        ({"name": "dr_grpo", "group_advantage": "grpo"}, 4, "algo.group_advantage"),
        ({"advantage": "spo"}, 4, "algo.advantage: 'spo' conflicts with algo.name = 'spo++'"),
        ({"name": "custom", "advantage": "spo", "normalization": "action_token"}, 4, "algo.advantage"),
        ({"name": "grpo", "normalization": "trajectory"}, 4, "algo.normalization: has no effect"),
        ({"name": "spo++", "group_size": 4}, 4, "algo.group_size: only the group estimator"),
        ({"name": "custom", "group_advantage": "grpo"}, 4, "algo.group_advantage: only the group estimator"),
        ({"name": "grpo", "group_size": 1}, 4, "algo.group_size: the group estimator needs >= 2"),
        ({"name": "grpo", "group_size": 3}, 4, "algo.group_size: 3 must divide controller.batch_size = 4"),
        ({"name": "dr_grpo"}, 6, "algo.group_size: 4 must divide controller.batch_size = 6"),
        ({"name": "spo", "rho": 0.9}, 4, "algo.rho: the arrival tracker adapts rho"),
        ({"name": "spo++", "arrival_rho_min": 0.8}, 4, "algo.arrival_rho_min: only the arrival tracker"),
        ({"name": "spo", "arrival_rho_min": 0.99}, 4, "arrival_rho_min <= arrival_rho_max"),
        ({"name": "ppo"}, 4, "algo.name: 'ppo' is not one of"),
        ({"tracker": "receipt"}, 4, "algo.tracker: 'receipt' is not one of"),
        ({"name": "gspo", "ratio_level": "token"}, 4, "algo.ratio_level: 'token' conflicts with algo.name"),
        ({"name": "dr_grpo", "loss_agg": "token_mean"}, 4, "algo.loss_agg: 'token_mean' conflicts"),
        ({"name": "reinforce++", "normalization": "trajectory"}, 4, "algo.normalization: has no effect"),
        ({"loss_agg_tokens": 100}, 4, "algo.loss_agg_tokens: only loss_agg"),
        ({"dual_clip_c": 0.5}, 4, "algo.dual_clip_c: must be > 1"),
        ({"is_cap": 0, "decoupled": True}, 4, "algo.decoupled: drops tokens"),
        ({"decoupled": True, "is_reject_high": 3.0}, 4, "algo.is_reject_high: algo.decoupled already"),
        ({"is_cap": 3.0, "is_reject_high": 2.0}, 4, "algo.is_cap: 3.0 >= algo.is_reject_high"),
        ({"is_reject_low": 1.2}, 4, "algo.is_reject_low: must lie in (0, 1)"),
        ({"is_reject_high": 0.9}, 4, "algo.is_reject_high: must be > 1"),
        ({"clip_low": 1.5}, 4, "algo.clip_low, algo.clip_high"),
        ({"entropy_coef": -0.1}, 4, "algo.entropy_coef: must be >= 0"),
        ({"is_level": "trajectory"}, 4, "algo.is_level: 'trajectory' is not one of"),
        ({"kl_estimator": "k2"}, 4, "algo.kl_estimator: has no effect with algo.kl_coef = 0"),
        ({"kl_in": "reward"}, 4, "algo.kl_in: has no effect with algo.kl_coef = 0"),
        ({"kl_coef": -1.0}, 4, "algo.kl_coef: must be >= 0"),
    ],
)
def test_bad_combinations_are_one_line_usage_errors(algo, batch, needle):
    with pytest.raises(UsageError) as info:
        build_config(algo, batch)
    assert needle in str(info.value) and "\n" not in str(info.value)


# ---- arrival tracker ----------------------------------------------------------------------------


def test_from_config_builds_the_configured_tracker():
    assert isinstance(make_core(AlgoConfig()).tracker, EventTimeTracker)
    core = make_core(AlgoConfig(name="spo"))
    assert isinstance(core.tracker, SPOTracker)
    assert core.tracker.rho == SPORho(rho_min=0.875, rho_max=0.96)
    assert core.group_size == 0


def test_arrival_rho_follows_the_drift_since_the_tasks_previous_fold():
    """First visit: D = 0, rho = rho_max; after k published versions, D = k * drift_per_version."""
    core = make_core(AlgoConfig(name="spo"), batch=1, steps=10)
    tracker = core.tracker
    assert isinstance(tracker, SPOTracker)

    def fold_one(reward):
        ticket = core.dispatch()
        before = tracker.effective_mass(ticket.task_id)
        core.on_result(finish(ticket, core.rollout_version, reward=reward))
        batch = core.next_batch()
        return ticket.task_id, before, tracker.effective_mass(ticket.task_id), batch

    task, before, after, batch = fold_one(1.0)
    assert after == pytest.approx(0.96 * before + 1.0)  # first visit: rho_max
    # publish versions until the same task is drawn again (one task in flight at a time)
    rhos = []
    for _ in range(9):
        core.on_published(batch.step + 1)
        core.on_rollout_version(core.version)
        last = dict(core.last_fold)
        t, before, after, batch = fold_one(0.0)
        if t in last:
            d = 0.006 * (core.version - last[t])
            rhos.append(((after - 1.0) / before, min(max(2 ** (-d / 0.06), 0.875), 0.96)))
    assert rhos, "some task was visited twice"
    for got, want in rhos:
        assert got == pytest.approx(want)
    assert any(got < 0.96 for got, _ in rhos)  # drift lowered rho below its D = 0 value


def test_arrival_tracker_folds_in_arrival_order():
    """Two results of one task at one policy event: the arrival tracker's value depends on their order,
    the event-time tracker's does not (SPO++ Remark 1)."""
    for name, order_matters in (("spo", True), ("spo++", False)):
        values = []
        for rewards in ((1.0, 0.0), (0.0, 1.0)):
            core = make_core(AlgoConfig(name=name, max_in_flight_per_task=2), batch=2, tasks=["x"])
            a, b = core.dispatch(), core.dispatch()
            core.on_result(finish(a, 0, reward=rewards[0]))
            core.on_result(finish(b, 0, reward=rewards[1]))
            values.append(core.tracker.value("x"))
        assert (values[0] != pytest.approx(values[1])) == order_matters


# ---- group estimator ----------------------------------------------------------------------------


def dispatch_all(core):
    out = []
    while (t := core.dispatch()) is not None:
        out.append(t)
    return out


def test_group_dispatch_is_back_to_back_whole_groups():
    core = make_core(AlgoConfig(name="grpo", group_size=2, max_in_flight_per_task=1), batch=4, steps=3)
    tickets = dispatch_all(core)
    assert len(tickets) == (0 + 1 + 1) * 4  # admission limit (rv + s + 1) * B, s = 1
    for a, b in zip(tickets[::2], tickets[1::2], strict=True):
        assert a.group_id == b.group_id != "" and a.task_id == b.task_id
        assert int(b.episode_id[2:]) == int(a.episode_id[2:]) + 1
        assert a.seed != b.seed  # distinct samples of one prompt
    assert len({t.group_id for t in tickets}) == 4
    assert core.admitted == core.admission_limit()


def test_group_barrier_and_grpo_advantages():
    core = make_core(AlgoConfig(name="grpo", group_size=2), batch=4, steps=3)
    tickets = dispatch_all(core)
    rewards = {t.episode_id: float(i % 3 == 0) for i, t in enumerate(tickets)}
    # finish one member of every group and the second member of the first group only
    for t in tickets[::2]:
        core.on_result(finish(t, 0, reward=rewards[t.episode_id]))
    core.on_result(finish(tickets[1], 0, reward=rewards[tickets[1].episode_id]))
    assert core.next_batch() is None  # only one whole group is back
    core.on_result(finish(tickets[5], 0, reward=rewards[tickets[5].episode_id]))
    batch = core.next_batch()
    assert batch is not None
    ids = [r.ticket.episode_id for r in batch.results]
    assert ids == sorted(e.episode_id for e in tickets[:2] + tickets[4:6])
    groups = [r.ticket.group_id for r in batch.results]
    assert all(groups.count(g) == 2 for g in groups)
    adv, diag = batch_advantages(batch, AlgoConfig(name="grpo", group_size=2))
    want = grpo_advantages(np.array([rewards[e] for e in ids]), groups)
    np.testing.assert_allclose(adv, want)
    dr, _ = batch_advantages(batch, AlgoConfig(name="dr_grpo", group_size=2))
    for g in set(groups):
        members = [i for i, x in enumerate(groups) if x == g]
        r = np.array([rewards[ids[i]] for i in members])
        np.testing.assert_allclose(dr[members], r - r.mean())
    assert math.isfinite(diag["max_abs"])


def test_tracker_estimator_uses_the_configured_normalisation():
    core = make_core(AlgoConfig(), batch=3)
    tickets = dispatch_all(core)[:3]
    for i, t in enumerate(tickets):
        core.on_result(finish(t, 0, reward=float(i == 0), n_action=i + 1))
    batch = core.next_batch()
    raw = np.array([r.trajectory.reward - r.ticket.baseline for r in batch.results])
    lengths = np.array([r.trajectory.num_action_tokens for r in batch.results])
    tok, diag = batch_advantages(batch, AlgoConfig())
    np.testing.assert_allclose(tok, token_normalized_advantages(raw, lengths))
    assert diag["token_mean"] == pytest.approx(0.0, abs=1e-12)
    traj, _ = batch_advantages(batch, AlgoConfig(name="custom", normalization="trajectory"))
    np.testing.assert_allclose(traj, (raw - raw.mean()) / (raw.std(ddof=1) + 1e-8))


def test_a_due_group_is_waited_for_even_when_its_pending_member_is_newer():
    """A group's staleness clock is its first member's v0: a batch waits for a due group even when the
    member still out was dispatched at a later version (its own ticket is not due)."""
    core = make_core(AlgoConfig(name="grpo", group_size=2), batch=2, steps=4)
    a0, a1, b0 = core.dispatch(), core.dispatch(), core.dispatch()  # b1 not yet dispatched (env slots)
    core.on_result(finish(a0, 0))
    core.on_result(finish(a1, 0))
    core.on_published(core.next_batch().step + 1)
    core.on_rollout_version(1)
    b1, c0, c1 = core.dispatch(), core.dispatch(), core.dispatch()
    assert (b1.group_id, b1.version) == (b0.group_id, 1) and c0.group_id == c1.group_id != b0.group_id
    for t in (b0, c0, c1):
        core.on_result(finish(t, t.version))
    assert core.waiting_for() == []  # no due ticket in flight (b1 has v0 = 1) ...
    assert core.next_batch() is None  # ... but b0's group is due at step 1 and is not back
    core.on_result(finish(b1, 1))
    batch = core.next_batch()
    assert {r.ticket.episode_id for r in batch.results} == {b0.episode_id, b1.episode_id}


def test_group_with_one_survivor_is_dropped_and_frees_its_slots():
    core = make_core(AlgoConfig(name="grpo", group_size=2), batch=2, steps=2)
    a, b = dispatch_all(core)[:2]  # one group
    assert a.group_id == b.group_id
    assert core.on_result(finish(a, 0, failed=True)) == "failed"
    assert core.on_result(finish(b, 0)) == "buffered"
    assert core.dropped["group_incomplete"] == 1 and not core.buffer
    assert core.failed["crash"] == 1 and core.balanced()
    assert core.admitted < core.admission_limit()  # the group's slots are free again


def test_group_with_two_survivors_trains_without_its_failed_member():
    core = make_core(AlgoConfig(name="grpo", group_size=4), batch=4, steps=2)
    tickets = dispatch_all(core)[:4]
    assert len({t.group_id for t in tickets}) == 1
    core.on_result(finish(tickets[0], 0, failed=True))
    for t in tickets[1:]:
        core.on_result(finish(t, 0, reward=float(t is tickets[1])))
    batch = core.next_batch()
    assert [r.ticket.episode_id for r in batch.results] == [t.episode_id for t in tickets[1:]]
    core.on_published(1)
    assert core.accounting()["trained"] == 3 and core.balanced()


def test_group_state_round_trips_through_a_checkpoint():
    algo = AlgoConfig(name="dr_grpo", group_size=2)
    core = make_core(algo, batch=4, steps=3)
    first = core.dispatch()
    core.on_result(finish(first, 0))  # the open group has one member back, one not yet dispatched
    state = json.loads(json.dumps(core.state_dict()))
    twin = make_core(algo, batch=4, steps=3)
    twin.load_state_dict(state)
    assert twin.groups == core.groups and twin.open_group == core.open_group == first.group_id
    assert twin.next_group == core.next_group and twin.state_dict() == core.state_dict()
    nxt = twin.dispatch()
    assert nxt.group_id == first.group_id and nxt.task_id == first.task_id
    assert core.dispatch() == nxt


def test_arrival_state_round_trips_through_a_checkpoint():
    core = make_core(AlgoConfig(name="spo"), batch=2)
    for t in dispatch_all(core):
        core.on_result(finish(t, 0, reward=0.0))
    state = json.loads(json.dumps(core.state_dict()))
    twin = make_core(AlgoConfig(name="spo"), batch=2)
    twin.load_state_dict(state)
    assert twin.last_fold == core.last_fold and twin.state_dict() == core.state_dict()
    with pytest.raises(ValueError, match="tracker"):
        make_core(AlgoConfig(), batch=2).load_state_dict(state)  # an event-time run refuses SPO's state


def test_old_tickets_and_checkpoints_load():
    ticket = EpisodeTicket("ep1", "t0", 0, 0, 0.5, 7, 0.0, group_id="g1")
    assert EpisodeTicket.from_dict(ticket.to_dict()) == ticket
    old = {k: v for k, v in ticket.to_dict().items() if k != "group_id"}
    assert EpisodeTicket.from_dict(old).group_id == ""
    core = make_core(AlgoConfig(), batch=2)
    state = core.state_dict()
    for key in ("groups", "open_group", "next_group", "last_fold"):
        del state[key]
    core.load_state_dict(state)
    assert core.groups == {} and core.open_group is None


@settings(max_examples=60, deadline=None)
@given(
    ops=EVENTS,
    mode=st.sampled_from(["async", "one_step_off", "sync"]),
    size_and_groups=st.sampled_from([(2, 1), (2, 2), (3, 1), (4, 1)]),
    seed=st.integers(0, 3),
    cap=st.integers(1, 2),
)
def test_group_interleavings_keep_invariants(ops, mode, size_and_groups, seed, cap):
    size, per_batch = size_and_groups
    algo = AlgoConfig(name="grpo", group_size=size, max_in_flight_per_task=cap)
    core = make_core(algo, mode=mode, batch=size * per_batch, steps=5, seed=seed)
    s = core.max_staleness
    trained_at = {}
    for op, pick in ops:
        b = play(core, op, pick, trained_at, s)
        if b is not None:
            groups = [r.ticket.group_id for r in b.results]
            assert len(set(groups)) == per_batch and all(groups.count(g) >= 2 for g in groups)
        assert all(core.sampler.in_flight(t) <= cap for t in TASKS)
    assert not core.dropped.get("stale")
    run_to_end(core, 300)  # liveness: finishing everything in flight lets the run reach its last step
    assert not core.in_flight and core.open_group is None
