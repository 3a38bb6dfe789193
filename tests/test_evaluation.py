"""Evaluation rounds: the `Evaluator` bookkeeping, the controller's routing of evaluation episodes (never
to the core, the tracker, the sampler or the store), env slot sharing, greedy turns, the held-out split
and the config keys. The real multi-process run is in tests/test_pipeline_mpi.py."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from rollart_hpc.config.loader import build
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.controller.evaluation import Evaluator, plan_items
from rollart_hpc.tasks.build import heldout_tasks, run_tasks
from rollart_hpc.tasks.episodes import (
    eval_episode_id,
    eval_round_of,
    is_eval_episode,
    is_greedy_episode,
    seed_key,
)
from rollart_hpc.tasks.types import Task


def task(tid: str) -> Task:
    family = tid.split("/")[0]
    return Task(tid, family, (family,), 4, "system", "objective")


TRAIN = [task("calc_math/0000"), task("calc_math/0003"), task("household/000")]
HELDOUT = [task("calc_math/1500"), task("household/128")]


def result(episode_id: str, task_id: str, success: bool, status: str = "ok", versions=(3, 3)) -> Trajectory:
    traj = Trajectory(task_id, task_id.split("/")[0], (), episode_id, success=success, reward=float(success))
    traj.append([1, 2], False, [], [])
    traj.append([5] * len(versions), True, [-0.5] * len(versions), list(versions))
    if status == "failed":
        traj.status, traj.finish_cause, traj.success = "failed", "crash", False
    return traj


def drain(evaluator: Evaluator) -> list:
    tickets = []
    while (t := evaluator.next_ticket()) is not None:
        tickets.append(t)
    return tickets


# ---- ids and plan ---------------------------------------------------------------------------------
def test_eval_ids_carry_round_and_mode_and_seed_key_drops_the_round():
    sampled, greedy = eval_episode_id(12, False, 3), eval_episode_id(12, True, 4)
    assert is_eval_episode(sampled) and not is_greedy_episode(sampled) and is_greedy_episode(greedy)
    assert eval_round_of(sampled) == 12 and eval_round_of("ep00000001") is None
    assert not is_eval_episode("ep00000001") and not is_greedy_episode("ep00000001")
    assert seed_key(f"{eval_episode_id(1, False, 3)}/t2") == seed_key(f"{eval_episode_id(9, False, 3)}/t2")
    assert seed_key("ep00000007/t1") == "ep00000007/t1"  # training seeds are unchanged


def test_plan_is_uniform_over_tasks_with_samples_and_greedy():
    items = plan_items(TRAIN, HELDOUT, samples=3, greedy=True)
    per_task = {t.id: sum(1 for i in items if i.task_id == t.id) for t in TRAIN + HELDOUT}
    assert set(per_task.values()) == {4}  # 3 sampled + 1 greedy, for every task
    assert {i.split for i in items if i.task_id in {t.id for t in HELDOUT}} == {"heldout"}
    assert sum(i.greedy for i in items) == len(TRAIN + HELDOUT)


def test_rounds_use_fixed_seeds_and_distinct_ids():
    ev = Evaluator(TRAIN, HELDOUT, every_steps=2, samples=2)
    ev.start(0)
    first = drain(ev)
    for t in first:
        ev.on_result(result(t.episode_id, t.task_id, False))
    ev.start(2)
    second = drain(ev)
    assert [t.seed for t in first] == [t.seed for t in second]
    assert [t.task_id for t in first] == [t.task_id for t in second]
    assert not {t.episode_id for t in first} & {t.episode_id for t in second}
    assert len({t.seed for t in first}) == len(first)  # each (task, sample) its own seed
    assert all(t.version == 2 for t in second)


# ---- results --------------------------------------------------------------------------------------
def test_round_row_per_split_family_and_greedy():
    ev = Evaluator(TRAIN, HELDOUT, every_steps=1, samples=2, greedy=True)
    ev.start(3)
    tickets = drain(ev)
    wins = {"calc_math/0000", "household/128"}
    row = None
    for t in tickets:
        greedy = is_greedy_episode(t.episode_id)
        failed = t.task_id == "calc_math/0003" and not greedy
        row = ev.on_result(
            result(t.episode_id, t.task_id, t.task_id in wins, "failed" if failed else "ok", (2, 3))
        )
        assert (row is None) == (t is not tickets[-1])
    assert row is not None and not ev.active
    assert row["kind"] == "eval" and row["step"] == row["version"] == 3
    assert row["eval_success"] == pytest.approx(1 / 3)
    assert row["eval_success/calc_math"] == 0.5 and row["eval_success/household"] == 0.0
    assert row["eval_success_greedy"] == pytest.approx(1 / 3)
    assert row["heldout_success"] == 0.5 and row["heldout_success/household"] == 1.0
    assert row["heldout_success_greedy/calc_math"] == 0.0
    assert row["eval_episodes"] == len(tickets) == 15 and row["eval_failed"] == 2
    assert (row["eval_token_version_min"], row["eval_token_version_max"]) == (2, 3)


def test_duplicate_unknown_and_stale_results_are_ignored():
    ev = Evaluator(TRAIN, [], every_steps=1)
    ev.start(0)
    tickets = drain(ev)
    assert ev.on_result(result(tickets[0].episode_id, tickets[0].task_id, True)) is None
    ev.on_result(result(tickets[0].episode_id, tickets[0].task_id, False))  # duplicate
    ev.on_result(result(eval_episode_id(7, False, 1), TRAIN[1].id, True))  # another round's
    ev.on_result(result("eval-nonsense", TRAIN[1].id, True))
    assert ev.ignored == 3 and ev.in_flight == len(tickets) - 1
    for t in tickets[1:]:
        row = ev.on_result(result(t.episode_id, t.task_id, False))
    assert row is not None and row["eval_success"] == pytest.approx(1 / 3)  # the duplicate changed nothing
    ev.on_result(result(tickets[1].episode_id, tickets[1].task_id, True))  # after the round
    assert ev.ignored == 4 and len(ev.rows) == 1


def test_schedule_periodic_final_and_resume():
    ev = Evaluator(TRAIN, HELDOUT, every_steps=5)
    assert ev.due(0)
    ev.start(0)
    assert not ev.due(5)  # one round at a time
    for t in drain(ev):
        ev.on_result(result(t.episode_id, t.task_id, False))
    assert not ev.due(4) and ev.due(5) and ev.due(7)
    ev.start(7)  # a late round evaluates the version of its start; the next is due at 10
    assert ev.next_due == 10
    for t in drain(ev):
        ev.on_result(result(t.episode_id, t.task_id, False))
    assert ev.final_due(8) and not ev.final_due(7)
    ev.resume(10)
    assert ev.next_due == 10  # a checkpoint at 10: its round is done again
    ev.resume(11)
    assert ev.next_due == 15
    off = Evaluator(TRAIN, HELDOUT, every_steps=0)
    assert not off.enabled and not off.due(0) and not off.final_due(3)


# ---- the controller: routing and slot sharing ------------------------------------------------------
class FakeMailbox:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, int, Tag]] = []

    def send(self, payload: Any, dest: int, tag: Tag) -> None:
        self.sent.append((payload, dest, tag))


def controller_for(tmp_path, mode: str = "async", **controller: Any):  # type: ignore[no-untyped-def]
    from rollart_hpc.controller.state import Controller

    tree = {
        "run": {"job": "rl"},
        "envs": {
            "families": ["calc_math"],
            "num_tasks": {"calc_math": 6},
            "calc_max_ops": 1,
            "num_slots": 4,
            "num_heldout": {"calc_math": 6},
        },
        "controller": {"mode": mode, "batch_size": 2, "num_steps": 3, "eval_every_steps": 2, **controller},
    }
    config = build(Config, tree)
    ranks = {"controller": [0], "rollout": [1], "env": [2], "reward": [3], "trainer": [4]}
    ctx = SimpleNamespace(run_dir=tmp_path, ranks=ranks, mailbox=FakeMailbox(), log=logging.getLogger("t"))
    return Controller(config, ctx, run_tasks(config.envs))  # type: ignore[arg-type]


def dispatched(controller) -> list:  # type: ignore[no-untyped-def]
    return [p for p, _, tag in controller.ctx.mailbox.sent if tag == Tag.DISPATCH]


def test_eval_results_never_reach_core_store_tracker_or_sampler(tmp_path):
    from rollart_hpc.store.trajectories import read_store

    c = controller_for(tmp_path)
    c.start_due_eval()
    assert c.evaluator.active
    c.dispatch()
    sent = dispatched(c)
    evals = [t for t in sent if is_eval_episode(t.episode_id)]
    train = [t for t in sent if not is_eval_episode(t.episode_id)]
    assert len(sent) == 4 and len(evals) == 2 and len(train) == 2  # eval holds at most half the slots
    tracker_before = json.dumps(c.core.tracker.state_dict(), sort_keys=True, default=str)
    sampler_before = json.dumps(c.core.sampler.state_dict(), sort_keys=True, default=str)
    acc_before = c.core.accounting()
    for t in evals:
        c.handle(SimpleNamespace(tag=Tag.RESULT, payload=result(t.episode_id, t.task_id, True), source=3))
    assert c.core.accounting() == acc_before and c.core.counts["ignored_unknown_or_duplicate"] == 0
    assert json.dumps(c.core.tracker.state_dict(), sort_keys=True, default=str) == tracker_before
    assert json.dumps(c.core.sampler.state_dict(), sort_keys=True, default=str) == sampler_before
    assert c.env_load[2] == 2  # the eval slots are free again
    while c.evaluator.active:  # training cannot dispatch more now (admission): eval takes the free slots
        c.dispatch()
        for payload in [p for p in dispatched(c) if is_eval_episode(p.episode_id) and p not in evals]:
            evals.append(payload)
            c.handle(
                SimpleNamespace(
                    tag=Tag.RESULT, payload=result(payload.episode_id, payload.task_id, True), source=3
                )
            )
    c.store.close()
    c.metrics.close()
    assert not read_store(tmp_path / "trajectories.h5").records  # no training result yet, no eval one
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["kind"] == "eval" and rows[0]["eval_success"] == 1.0
    assert rows[0]["heldout_success/calc_math"] == 1.0 and rows[0]["eval_episodes"] == 6 + 6
    assert c.core.accounting()["dispatched"] == 2


def test_sync_mode_evaluates_between_steps(tmp_path):
    c = controller_for(tmp_path, mode="sync")
    c.start_due_eval()
    c.dispatch()
    sent = dispatched(c)
    assert sent and all(is_eval_episode(t.episode_id) for t in sent)  # training waits for the round
    assert c.core.accounting()["dispatched"] == 0
    c.store.close()
    c.metrics.close()


# ---- greedy turns ---------------------------------------------------------------------------------
def test_greedy_agent_samples_at_temperature_zero():
    from rollart_hpc.contracts.generation import RequestOutput
    from rollart_hpc.envs.worker import EnvWorker, EnvWorkerConfig
    from rollart_hpc.models.tiny import make_tiny_tokenizer
    from rollart_hpc.tasks.agent_loop import AgentConfig

    class Recorder:
        def __init__(self) -> None:
            self.temperatures: list[float] = []

        async def generate(self, request_id, prompt, sampling):  # type: ignore[no-untyped-def]
            self.temperatures.append(sampling.temperature)
            return RequestOutput(request_id, prompt, [65], [0.0], [0], "A", True, "stop")

        async def abort(self, request_id: str) -> None:
            pass

    async def play() -> list[float]:
        client = Recorder()
        agent = AgentConfig(max_context_tokens=4096, temperature=0.8)
        async with EnvWorker(EnvWorkerConfig(num_slots=1), agent, make_tiny_tokenizer()) as worker:
            fam_task = run_tasks(build(Config, {"envs": {"families": ["calc_math"]}}).envs)[0]
            await worker.run_episode(fam_task, client, episode_id="a")
            greedy = AgentConfig(max_context_tokens=4096, temperature=0.0)
            await worker.run_episode(fam_task, client, episode_id="b", agent=greedy)
        return client.temperatures

    temps = asyncio.run(play())
    assert temps[0] == 0.8 and temps[-1] == 0.0 and set(temps) == {0.8, 0.0}


# ---- held-out split and config --------------------------------------------------------------------
def test_calc_heldout_is_disjoint_from_training_by_id_and_text():
    from rollart_hpc.tasks.families.calc_math import CalcMathFamily, generate_problem, parse_task_id

    envs = build(Config, {"envs": {"families": ["calc_math"], "calc_max_ops": 3}}).envs
    train, held = run_tasks(envs), heldout_tasks(envs)
    assert len(held) == 32 and len(train) == 1500
    assert not {t.id for t in train} & {t.id for t in held}
    texts = {generate_problem(parse_task_id(t.id)).text for t in train}
    assert not texts & {generate_problem(parse_task_id(t.id)).text for t in held}
    fam = CalcMathFamily(max_ops=1)
    assert all(t.tags == ("calc_math", "ops1") for t in fam.heldout_tasks(30))
    assert fam.task(held[0].id).id == held[0].id  # a held-out id resolves (env children reset on it)


def test_household_heldout_games_are_new_games():
    from rollart_hpc.tasks.families.household_data import is_ready, load_manifest, prepare

    if not (is_ready() and is_ready(heldout=True)):
        prepare(num_procs=2)
    train, held = load_manifest(), load_manifest(heldout=True)
    assert len(held) == 16 and min(g["index"] for g in held) == len(train) == 128
    assert not {g["seed"] for g in train} & {g["seed"] for g in held}
    assert not {g["sha256"] for g in train} & {g["sha256"] for g in held}
    envs = build(Config, {"envs": {"families": ["household", "calc_math"]}}).envs
    train_ids = {t.id for t in run_tasks(envs)}
    held_ids = {t.id for t in heldout_tasks(envs)}
    assert len(held_ids) == 16 + 32 and not train_ids & held_ids


def test_warm_start_and_tokenizer_corpus_use_training_tasks_only(monkeypatch):
    import rollart_hpc.controller.model_prep as model_prep
    import rollart_hpc.train.main as train_main

    # Both build their data from `run_tasks` (training tasks only), never from the held-out split.
    assert model_prep.run_tasks is run_tasks and train_main.run_tasks is run_tasks


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        ("controller", {"eval_every_steps": -1}, "eval_every_steps >= 0"),
        ("controller", {"eval_samples": 0}, "eval_samples >= 1"),
        ("envs", {"num_heldout": {"frozenlake": 1}}, "num_heldout.frozenlake: family not in"),
        ("envs", {"families": ["frozenlake"], "num_heldout": {"frozenlake": 1}}, "must be in [0, 0]"),
        ("envs", {"num_heldout": {"calc_math": 501}}, "must be in [0, 500]"),
        ("envs", {"num_heldout": {"household": -1}}, "must be in [0, 16]"),
    ],
)
def test_eval_config_is_validated_in_one_line(section, values, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        build(Config, {section: values})
    assert "\n" not in str(err.value)


def test_eval_config_defaults():
    config = build(Config, {})
    assert config.controller.eval_every_steps == 10 and config.controller.eval_samples == 1
    assert not config.controller.eval_greedy
    assert config.envs.heldout_count("household") == 16 and config.envs.heldout_count("calc_math") == 32
    assert config.envs.heldout_count("frozenlake") == 0


def test_resume_truncation_redoes_the_checkpoint_versions_round(tmp_path):
    from rollart_hpc.metrics.run_metrics import MetricsWriter, is_eval_row, truncate_metrics

    writer = MetricsWriter(tmp_path, tensorboard=False)
    for row in [
        {"kind": "eval", "step": 0, "version": 0, "eval_success": 0.1},
        {"step": 0, "version": 1, "train_success": 0.0},
        {"step": 1, "version": 2, "train_success": 0.5},
        {"kind": "eval", "step": 2, "version": 2, "eval_success": 0.3},  # written after the checkpoint at 2
        {"step": 2, "version": 3, "train_success": 0.5},
    ]:
        writer.log(row)
    writer.close()
    kept = truncate_metrics(tmp_path, 2)  # resumed from the checkpoint at version 2
    assert [(is_eval_row(r), r["step"]) for r in kept] == [(True, 0), (False, 0), (False, 1)]
    ev = Evaluator(TRAIN, HELDOUT, every_steps=2)
    ev.resume(2)
    assert ev.due(2) and not ev.due(1)  # version 2 is evaluated again, once


def test_report_keeps_eval_rows_apart_from_steps(tmp_path):
    from rollart_hpc.metrics.report import _eval_lines, load_run

    (tmp_path / "config.resolved.toml").write_text("[controller]\nnum_steps = 2\n")
    rows = [
        {"kind": "eval", "step": 0, "version": 0, "eval_success": 0.25, "heldout_success": 0.5},
        {"step": 0, "version": 1, "wall_s": 1.0, "train_success": 0.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path)
    assert [r["step"] for r in run.rows] == [0] and "kind" not in run.rows[0]
    assert run.eval_rows == rows[:1]
    assert "| 0 | 0.250 | 0.500 |" in _eval_lines(run.eval_rows)


def test_launch_eval_bad_inputs_are_one_line_errors(tmp_path, capsys):
    from pathlib import Path

    from rollart_hpc.config import load_config, write_resolved
    from rollart_hpc.entry.cli import main

    repo = Path(__file__).resolve().parent.parent
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    run_dir = tmp_path / "run"
    write_resolved(load_config(repo / "configs" / "tiny.toml"), run_dir)
    assert main(["eval", str(run_dir)]) == 2
    assert main(["eval", str(run_dir), "--checkpoint", "step-3"]) == 2
    assert main(["eval", str(run_dir), "--checkpoint", "last-one"]) == 2
    smoke_dir = tmp_path / "smoke"
    write_resolved(load_config(repo / "configs" / "smoke.toml"), smoke_dir)
    assert main(["eval", str(smoke_dir)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 5 and all(line.startswith("error: ") for line in lines)
    assert "is not a run directory" in lines[0] and "no complete checkpoint to evaluate" in lines[1]
    assert "no complete checkpoint step-000003" in lines[2] and "not of the form step-N" in lines[3]
    assert "only RL runs" in lines[4]
