"""`bench e2e`: target and speedup arithmetic, argument checks, and (slow) a real run of tiny worlds."""

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rollart_hpc.bench import e2e
from rollart_hpc.contracts.errors import UsageError

REPO = Path(__file__).resolve().parent.parent


def args_for(tmp_path, **over):
    values = dict(
        json=tmp_path / "e2e.json",
        config=REPO / "configs" / "tiny.toml",
        steps=4,
        batch=4,
        modes="sync,one_step_off,async",
        latency="pareto",
        latency_scale_s=0.05,
        latency_max_s=1.0,
        seeds="0",
        metric="train",
        target_success=None,
        target_fraction=0.8,
        window=2,
        out_dir=None,
        timeout_s=60.0,
        overrides=[],
    )
    values.update(over)
    return argparse.Namespace(**values)


def rows(walls, successes):
    return [
        {"step": i, "wall_s": w, "train_success": s, "trained_trajectories": 4}
        for i, (w, s) in enumerate(zip(walls, successes, strict=True))
    ]


def train(walls, successes, window=2):
    return e2e.success_series(rows(walls, successes), [], "train", window)


def test_target_from_the_sync_gain_and_time_to_reach_it(tmp_path):
    sync = train([1, 2, 3, 4], [0.0, 0.5, 0.5, 1.0])
    target = e2e.pick_target(args_for(tmp_path), [sync])
    # trailing means over 2 steps: 0, 0.25, 0.5, 0.75 -> start 0, final 0.75, target 0.6 at step 3
    assert target["defined"] and target["values"] == [pytest.approx(0.8 * 0.75)]
    assert e2e.time_to_target(sync, target, 0) == 4.0
    assert e2e.time_to_target(train([1, 2], [0.0, 0.2]), target, 0) is None
    fixed = e2e.pick_target(args_for(tmp_path, target_success=0.25), [sync])
    assert fixed["values"] == [0.25] and e2e.time_to_target(sync, fixed, 0) == 2.0


def test_eval_target_is_per_seed_from_its_sync_run(tmp_path):
    evals = [
        [{"wall_s": 5.0, "eval_success": 0.3}, {"wall_s": 50.0, "eval_success": 0.4}, {"wall_s": 90.0, "eval_success": 0.5}],
        [{"wall_s": 6.0, "eval_success": 0.4}, {"wall_s": 60.0, "eval_success": 0.6}, {"wall_s": 95.0, "eval_success": 0.7}],
    ]  # fmt: skip
    series = [e2e.success_series([], rounds, "eval", 3) for rounds in evals]
    target = e2e.pick_target(args_for(tmp_path, metric="eval", target_fraction=0.5), series)
    # each seed from its own start: 0.3 + 0.5 x 0.2 and 0.4 + 0.5 x 0.3; one absolute target (0.475)
    # would have timed seed 1 against seed 0's weaker start
    assert target["values"] == [pytest.approx(0.4), pytest.approx(0.55)]
    assert [e2e.time_to_target(s, target, i) for i, s in enumerate(series)] == [50.0, 60.0]
    seeds = [{"time_to_target_s": 90.0, "final_success": 0.5, "steps": 3, "trained_trajectories": 12,
              "wall_s": 100.0, "trajectories_per_s": 1.0, "tokens_per_s": 10.0, "balanced": True,
              "busy_fraction_by_role": {"env": 0.5}},
             {"time_to_target_s": None, "final_success": 0.7, "steps": 3, "trained_trajectories": 12,
              "wall_s": 110.0, "trajectories_per_s": 2.0, "tokens_per_s": 20.0, "balanced": True,
              "busy_fraction_by_role": {"env": 0.7}}]  # fmt: skip
    mode = e2e.mode_result(seeds)
    assert mode["time_to_target_s"] is None and mode["time_to_target_per_seed_s"] == [90.0, None]
    assert mode["trajectories_per_s"] == 1.5 and mode["busy_fraction_by_role"]["env"] == pytest.approx(0.6)


def test_target_is_undefined_without_a_sync_gain(tmp_path):
    target = e2e.pick_target(args_for(tmp_path), [train([1, 2], [0.0, 0.0])])
    assert not target["defined"] and "undefined" in target["note"]
    assert e2e.time_to_target(train([1], [1.0]), target, 0) is None
    no_rows = e2e.pick_target(args_for(tmp_path, metric="eval"), [[]])
    assert not no_rows["defined"] and "no eval success rows" in no_rows["note"]
    # one seed without a sync gain: only that seed's target is undefined
    mixed = e2e.pick_target(
        args_for(tmp_path, seeds="3,5"), [train([1, 2], [0.5, 0.2]), train([1, 2], [0.0, 1.0])]
    )
    assert mixed["defined"] and mixed["values"][0] is None and mixed["values"][1] is not None
    assert "seed 3 gained no success" in mixed["note"]  # named by its run.seed, not its position


def test_speedups_are_ratios_to_sync():
    results = {
        "sync": {"time_to_target_per_seed_s": [10.0, 30.0], "trajectories_per_s": 2.0, "wall_s": 20.0},
        "async": {"time_to_target_per_seed_s": [5.0, 15.0], "trajectories_per_s": 3.0, "wall_s": 16.0},
        "one_step_off": {
            "time_to_target_per_seed_s": [None, 20.0],
            "trajectories_per_s": 2.5,
            "wall_s": 18.0,
        },
    }
    e2e.add_speedups(results)
    assert results["sync"]["speedup_wall"] == 1.0 and results["sync"]["speedup_time_to_target"] == 1.0
    assert results["async"]["speedup_time_to_target"] == 2.0
    assert results["async"]["speedup_time_to_target_seeds"] == 2
    # over the seeds where both reached the target: 30 / 20, from one seed
    assert results["one_step_off"]["speedup_time_to_target"] == 1.5
    assert results["one_step_off"]["speedup_time_to_target_seeds"] == 1
    assert results["async"]["speedup_throughput"] == 1.5 and results["async"]["speedup_wall"] == 1.25


def test_a_rerun_reuses_finished_runs_of_the_same_command_only(tmp_path):
    args = args_for(tmp_path)
    finished = (tmp_path / "sync" / "seed=0").resolve()
    finished.mkdir(parents=True)
    (finished / "summary.json").write_text("{}")
    with pytest.raises(UsageError, match="other settings"):  # not made by this bench
        e2e.run_mode(args, "sync", 0, tmp_path)
    cmd = ["run", str(args.config.resolve()), "--run-dir", str(finished)]
    cmd += [*e2e.mode_overrides(args, "sync"), "run.seed=0"]
    (finished / e2e.COMMAND_FILE).write_text(json.dumps(cmd))
    assert e2e.run_mode(args, "sync", 0, tmp_path) == finished  # reused: no run started
    with pytest.raises(UsageError, match="other settings"):  # the same directory, other steps
        e2e.run_mode(args_for(tmp_path, steps=5), "sync", 0, tmp_path)
    (tmp_path / "async" / "seed=0").mkdir(parents=True)
    with pytest.raises(UsageError, match="unfinished run"):
        e2e.run_mode(args, "async", 0, tmp_path)


def test_mode_overrides_fix_everything_but_the_mode(tmp_path):
    args = args_for(tmp_path)
    sync, asy = e2e.mode_overrides(args, "sync"), e2e.mode_overrides(args, "async")
    assert 'controller.mode="sync"' in sync and "controller.max_staleness=1" in asy
    assert [o for o in sync if "mode" not in o] == [
        o for o in asy if "mode" not in o and "staleness" not in o
    ]
    assert 'envs.faults.latency="pareto"' in sync and "envs.faults.latency_max_s=1.0" in sync


def test_bad_arguments_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="sync included"):
        e2e.check_args(args_for(tmp_path, modes="async"))
    with pytest.raises(UsageError, match="target-fraction"):
        e2e.check_args(args_for(tmp_path, target_fraction=0.0))
    with pytest.raises(UsageError, match="key=value"):
        e2e.check_args(args_for(tmp_path, overrides=["oops"]))
    with pytest.raises(UsageError, match="a seed is repeated"):
        e2e.check_args(args_for(tmp_path, seeds="1,1"))
    with pytest.raises(UsageError, match="eval_every_steps > 0"):
        e2e.check_metric(args_for(tmp_path, metric="eval"))  # tiny.toml has no evaluation rounds
    e2e.check_metric(args_for(tmp_path, metric="eval", overrides=["controller.eval_every_steps=2"]))
    assert e2e.check_args(args_for(tmp_path, modes="async,sync")) == ["sync", "async"]


@pytest.mark.slow
@pytest.mark.mpi
def test_bench_e2e_tiny(tmp_path):
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(REPO / "launch.py"), "bench", "e2e", "--json", str(out), "--steps", "2"]
    cmd += [
        "--config",
        str(REPO / "configs" / "tiny.toml"),
        "--batch",
        "4",
        "--modes",
        "sync,async",
        "--latency-scale-s",
        "0.02",
        "--target-success",
        "0.0001",
        "--metric",
        "train",
        "--shared-warm-start",
    ]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["modes"]) == {"sync", "async"}
    for mode, r in data["modes"].items():
        assert r["steps"] == 2 and r["trained_trajectories"] == 8 and r["balanced"], mode
        assert len(r["seeds"]) == 1 and len(r["seeds"][0]["series"]) == 2
        assert set(r["busy_fraction_by_role"]) == {"env", "reward", "rollout", "trainer"}
        assert all(0 <= f <= 1 for f in r["busy_fraction_by_role"].values())
        assert (Path(r["seeds"][0]["run_dir"]) / "report" / "report.md").exists()
    assert data["modes"]["sync"]["speedup_wall"] == 1.0
    assert set(
        json.loads((Path(data["modes"]["async"]["seeds"][0]["run_dir"]) / "summary.json").read_text())[
            "staleness"
        ]
    ) <= {
        "0",
        "1",
    }
    # both modes started from the one warm start of seed 0, with no supervised steps of their own
    warm = tmp_path / "e2e-runs" / "warm" / "seed=0"
    assert (warm / "summary.json").exists() and data["workload"]["shared_warm_start"]
    assert (warm / e2e.COMMAND_FILE).exists()
    for mode in ("sync", "async"):
        resolved = tomllib.loads(
            (tmp_path / "e2e-runs" / mode / "seed=0" / "config.resolved.toml").read_text()
        )
        assert resolved["model"]["source"] == "path" and resolved["trainer"]["sft_steps"] == 0, mode
        assert resolved["model"]["path"] == str(warm.resolve() / "model" / "warm"), mode
    for png in data["plots"].values():
        assert Path(png).read_bytes()[:4] == b"\x89PNG"
