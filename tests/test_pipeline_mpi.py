"""End-to-end RL runs as real MPI worlds (controller, rollout, env, reward, trainer ranks) on tiny settings.

Checks the invariants of `rollart_hpc/controller/core.py` across processes: every dispatched trajectory
ends exactly once (trained, dropped or failed with a cause), in the HDF5 store as in the controller's
counters; no trained token is older than max_staleness versions; rollout engines load every published
version in order; `sync` trains on exactly what `async` with max_staleness 0 trains on for the same seed.
"""

import json
from collections import defaultdict

import pytest
from launching import (
    launch,
    metric_rows,
    rank_pid,
    read_summary,
    run,
    settled_summary,
    start_run,
    stored_records,
    wait_until,
)

from rollart_hpc.sim.profile import calibrate

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def trained_by_step(run_dir):
    steps = defaultdict(list)
    for rec in stored_records(run_dir):
        if rec.final_status == "trained":
            steps[rec.final_version].append((rec.episode_id, rec.task_id))
    return {k: sorted(v) for k, v in steps.items()}


def test_async_run_accounts_for_every_trajectory(tmp_path):
    run_dir = run(
        tmp_path / "async",
        "controller.mode=async",
        "controller.max_staleness=1",
        "envs.faults.crash_prob=0.1",
        "trainer.lr=4e-3",
        "trainer.rl_lr_warmup_steps=2",
    )
    summary = settled_summary(run_dir)
    acc = summary["accounting"]
    records = stored_records(run_dir)
    assert len({r.episode_id for r in records}) == len(records) == acc["dispatched"]
    by_status = defaultdict(int)
    for r in records:
        by_status[r.final_status] += 1
        assert r.final_status in ("trained", "dropped", "failed")
        if r.final_status != "trained":
            assert r.final_cause, r.episode_id
    assert by_status["trained"] == acc["trained"] == 3 * 4
    assert by_status["failed"] == sum(acc["failed"].values())
    assert by_status["dropped"] == sum(acc["dropped"].values())
    for r in records:
        if r.final_status == "trained":
            generated = [v for v, m in zip(r.versions, r.action_mask, strict=True) if m]
            assert r.final_version - min(generated) <= 1
    loaded = summary["rollout_versions"]
    for versions in loaded.values():
        assert versions == sorted(versions) and versions[-1] == 3
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["version"] for r in rows] == [1, 2, 3]
    for key in ("wall_s", "trained_trajectories", "train_success", "train_success/calc_math"):
        assert key in rows[0]
    assert [r["lr"] for r in rows] == pytest.approx([2e-3, 4e-3, 4e-3])  # the warmup, applied by the trainer
    # the controller's trace holds every stored episode once, and the scale simulator calibrates on it
    trace = [json.loads(line) for line in (run_dir / "timeline/controller.jsonl").read_text().splitlines()]
    assert sorted(e["id"] for e in trace if e["e"] == "result") == sorted(r.episode_id for r in records)
    assert [e["step"] for e in trace if e["e"] == "trained"] == [0, 1, 2]
    profile, measured = calibrate(run_dir, num_rollouts=1)
    assert measured.trained == 12 and len(profile.episodes) == len(records)
    # turns here mostly generate up to the same token limit, so the fit may put the whole cost on the prompts
    llm_cost = profile.decode_s + profile.decode_s_per_request + profile.prefill_s_per_token
    assert llm_cost > 0 and profile.fit["mean_llm_s"] > 0


def test_sync_equals_async_with_zero_staleness(tmp_path):
    sync_dir = run(tmp_path / "sync", "controller.mode=sync")
    async_dir = run(tmp_path / "async0", "controller.mode=async", "controller.max_staleness=0")
    assert trained_by_step(sync_dir) == trained_by_step(async_dir)
    assert len(trained_by_step(sync_dir)) == 3


def test_trainer_log_probs_equal_the_behaviour_log_probs_at_the_sampling_temperature(tmp_path):
    """Sync mode trains step 0 on version 0's samples: at rollout.temperature 0.7 the trainer's log-probs
    of every action token equal the engine's recorded ones (importance ratio 1)."""
    run_dir = run(
        tmp_path / "hot", "controller.mode=sync", "controller.num_steps=1", "rollout.temperature=0.7"
    )
    (row,) = metric_rows(run_dir)
    assert row["step"] == 0 and row["num_action_tokens"] > 0
    assert row["max_abs_behaviour_log_ratio"] < 1e-5
    assert row["is_weight"] == pytest.approx(1.0, abs=1e-5)


def test_the_console_of_a_first_run_is_quiet(tmp_path, monkeypatch):
    """What a user sees on a fresh machine (the tiny model built, not copied from the cache): every line a
    log line of the run or its summary table, the table once; no warning from any rank, no progress bar."""
    monkeypatch.setenv("ROLLART_HPC_CACHE", str(tmp_path / "cache"))
    result = launch("run", "configs/tiny.toml", "--run-dir", tmp_path / "run", "controller.num_steps=1")
    console = result.stdout + result.stderr
    assert (tmp_path / "cache/tiny-models").is_dir()  # this run built the model
    for noise in ("Warning", "warn(", "it/s]", "%|"):
        assert noise not in console, [line for line in console.splitlines() if noise in line]
    assert sum("trajectories trained" in line for line in console.splitlines()) == 1, console[-3000:]


def assert_complete_once(run_dir, num_steps, batch):
    summary = read_summary(run_dir)
    assert summary["balanced"]
    records = stored_records(run_dir)
    ids = [r.episode_id for r in records]
    assert len(ids) == len(set(ids)), "a trajectory was stored twice"
    trained = [r for r in records if r.final_status == "trained"]
    assert len(trained) == num_steps * batch == summary["accounting"]["trained"]
    assert all(
        r.final_status in ("trained", "dropped", "failed") and (r.final_status == "trained" or r.final_cause)
        for r in records
    )
    assert [r["step"] for r in metric_rows(run_dir)] == list(range(num_steps))


def test_stop_signal_checkpoints_then_resume_finishes(tmp_path):
    import signal

    run_dir = tmp_path / "preempted"
    proc = start_run(run_dir, "controller.num_steps=8", "controller.checkpoint_every_steps=0")
    wait_until(lambda: len(metric_rows(run_dir)) >= 2, 600)
    import os

    os.kill(rank_pid(run_dir, 0), signal.SIGUSR2)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "stop requested: checkpointed at version" in out
    assert not (run_dir / "summary.json").exists()
    stopped_at = len(metric_rows(run_dir))
    result = launch("resume", run_dir)
    assert f"resumed from {run_dir / 'checkpoints'}" in result.stdout
    assert_complete_once(run_dir, 8, 4)
    assert stopped_at < 8


def test_killed_rank_is_named_and_resume_continues(tmp_path):
    import os
    import signal

    from rollart_hpc.controller.checkpoint import latest

    run_dir = tmp_path / "killed"
    proc = start_run(run_dir, "controller.num_steps=4", "controller.checkpoint_every_steps=1")
    wait_until(lambda: latest(run_dir) is not None and len(metric_rows(run_dir)) >= 2, 600)
    os.kill(rank_pid(run_dir, 2), signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "rank 2 (env) died without reporting an error (killed or crashed)" in err
    launch("resume", run_dir)
    assert_complete_once(run_dir, 4, 4)


def test_eval_rounds_in_run_and_standalone_eval_of_a_checkpoint(tmp_path):
    """Evaluation rounds during a run (every step, greedy too, held-out split) and at its end, outside the
    training accounting; then `launch.py eval` of the run's checkpoint through a world of its own."""
    run_dir = run(
        tmp_path / "eval",
        "controller.num_steps=2",
        "controller.eval_every_steps=1",
        "controller.eval_greedy=true",
        "controller.checkpoint_every_steps=1",
    )
    all_rows = metric_rows(run_dir)
    evals = [r for r in all_rows if r.get("kind") == "eval"]
    assert [r["step"] for r in all_rows if r.get("kind") != "eval"] == [0, 1]
    assert evals[0]["version"] == 0 and evals[-1]["version"] == 2  # the first version and the final one
    for r in evals:
        for key in (
            "eval_success",
            "eval_success/calc_math",
            "eval_success_greedy",
            "heldout_success/calc_math",
        ):
            assert 0.0 <= r[key] <= 1.0
        assert r["eval_episodes"] == 2 * (12 + 32) and r["step"] == r["version"]
    summary = read_summary(run_dir)
    assert (
        summary["balanced"] and summary["accounting"]["dispatched"] == summary["accounting"]["trained"] == 8
    )
    assert summary["eval"]["version"] == 2
    records = stored_records(run_dir)
    assert len(records) == 8 and not [r for r in records if r.episode_id.startswith("eval-")]
    result = launch("eval", run_dir, "--checkpoint", "step-1")
    assert "heldout_success/calc_math" in result.stdout
    out = json.loads((run_dir / "eval-step-000001.json").read_text())
    assert out["version"] == out["row"]["version"] == 1 and out["row"]["eval_episodes"] == 2 * (12 + 32)
    assert {out["row"]["eval_token_version_min"], out["row"]["eval_token_version_max"]} == {1}
    assert not (run_dir / "eval-step-000002.json").exists()


def test_gspo_arm_with_kl_and_entropy_logs_both_per_step(tmp_path):
    """A new arm end to end: GSPO's sequence ratio, a KL to the warm start and an entropy bonus; every RL
    step logs kl (0 while the policy is still the reference) and the action-token entropy."""
    run_dir = run(
        tmp_path / "gspo",
        "algo.name=gspo",
        "algo.kl_coef=0.01",
        "algo.kl_estimator=k3",
        "algo.entropy_coef=0.001",
        "controller.mode=sync",
        "controller.num_steps=2",
    )
    rows = metric_rows(run_dir)
    steps = [r for r in rows if "num_updates" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] >= 0.0
    assert all(0.0 < r["entropy"] < 6.0 for r in steps)  # below log(400), the tiny vocabulary
    assert all("is_rejected_fraction" in r for r in steps)
