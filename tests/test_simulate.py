"""The scale simulator: a calibration recovers the costs of a known pipeline from its trace, and predicts
its throughput; the real controller core paces the simulated runs (the sync barrier costs throughput);
bad input is a one-line error. Real runs' traces are checked in tests/test_pipeline_mpi.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart_hpc.config import load_config, write_resolved
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry import cli
from rollart_hpc.metrics.trace import TraceWriter, turn_segments
from rollart_hpc.sim.model import Scenario, Simulation, refine, simulate
from rollart_hpc.sim.profile import EpisodeShape, Profile, calibrate

REPO = Path(__file__).resolve().parents[1]

TRUTH = Profile(
    episodes=tuple(
        EpisodeShape(
            reset_s=0.01,
            prompt=(40 + 7 * i, 12),
            gen=(8 + i, 5 + 2 * i),
            env_s=(0.02 * i, 0.05),
            post_s=0.01,
            tokens=65 + 10 * i,  # prompts and answers: every token of the episode
        )
        for i in range(6)
    ),
    decode_s=0.004,
    decode_s_per_request=0.001,
    prefill_s_per_token=0.0002,
    train_s=0.05,
    train_s_per_token=0.0001,
    swap_s=(0.05,),
)


def tiny(*overrides: str):
    return load_config(REPO / "configs/tiny.toml", ["controller.num_steps=12", *overrides])


def traced_run(run_dir: Path, *overrides: str) -> None:
    """A simulated run of `TRUTH` that leaves a run directory like a real run's (config and trace)."""
    config = tiny(*overrides)
    run_dir.mkdir(parents=True)
    write_resolved(config, run_dir)
    writer = TraceWriter(run_dir)
    Simulation(Scenario(config), TRUTH, seed=7, trace=writer).run()
    writer.close()


def test_turn_segments_split_prompt_and_generated_runs():
    assert turn_segments([0, 0, 1, 1, 1, 0, 1, 0, 0]) == [(2, 3), (1, 1)]
    assert turn_segments([1, 1]) == [(0, 2)]
    assert turn_segments([0, 0]) == []


def test_calibration_recovers_a_known_pipeline_and_predicts_it(tmp_path):
    traced_run(tmp_path / "run", "roles.rollout.num_ranks=2", "rollout.num_slots=3")
    profile, measured = calibrate(tmp_path / "run", num_rollouts=2)
    b = profile.fit["mean_concurrency"]  # the step cost at the run's own load is what the trace pins down
    step = profile.decode_s + profile.decode_s_per_request * b
    assert step == pytest.approx(TRUTH.decode_s + TRUTH.decode_s_per_request * b, rel=0.15)
    assert profile.train_s + profile.train_s_per_token * 400 == pytest.approx(0.05 + 0.0001 * 400, rel=0.05)
    assert profile.swap_s[0] == pytest.approx(0.05)
    assert measured.steps == 12 and measured.trained == 48
    scenario = Scenario(tiny("roles.rollout.num_ranks=2", "rollout.num_slots=3"))
    profile = refine(profile, scenario)
    predicted = simulate(scenario, profile, seeds=3)
    assert predicted["trajectories_per_s"] == pytest.approx(measured.trajectories_per_s, rel=0.15)
    assert predicted["step_s"] == pytest.approx(measured.step_s, rel=0.15)
    assert predicted["busy"]["rollout"] > 0.3  # the engines, not the trainer, pace this pipeline


def test_the_real_core_paces_the_simulation():
    slow_env = Profile(**{**TRUTH.__dict__, "train_s": 0.5})
    sync = simulate(Scenario(tiny("controller.mode=sync")), slow_env, seeds=2)
    asynchronous = simulate(Scenario(tiny("controller.mode=async")), slow_env, seeds=2)
    assert asynchronous["trajectories_per_s"] > 1.1 * sync["trajectories_per_s"]  # overlap with training
    faster = simulate(Scenario(tiny("controller.mode=sync"), trainer_speed=4.0), slow_env, seeds=2)
    assert faster["step_s"] < sync["step_s"]


def test_simulate_command_validates_and_projects(tmp_path, capsys):
    traced_run(tmp_path / "run")
    traced_run(tmp_path / "other", "controller.mode=sync")
    out = tmp_path / "sim.json"
    code = cli.main(
        [
            "simulate", str(REPO / "configs/tiny.toml"), "roles.rollout.num_ranks=4", "--calibrate",
            str(tmp_path / "run"), "--check", str(tmp_path / "other"), "--modes", "sync,async",
            "--staleness", "0,2", "--seeds", "2", "--json", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert [c["mode"] for c in result["validation"]] == ["async", "sync"]
    assert all(abs(c["error"]["trajectories_per_s"]) < 0.15 for c in result["validation"])
    assert [(p["mode"], p["staleness"]) for p in result["projection"]] == [
        ("sync", 0),
        ("async", 0),
        ("async", 2),
    ]
    assert "validation (predicted vs measured)" in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "norun").mkdir()
    assert (
        cli.main(["simulate", str(REPO / "configs/tiny.toml"), "--calibrate", str(tmp_path / "norun")]) == 2
    )
    assert "is not a run directory" in capsys.readouterr().err
    traced_run(tmp_path / "run")
    args = ["simulate", str(REPO / "configs/tiny.toml"), "--calibrate", str(tmp_path / "run")]
    assert cli.main([*args, "--modes", "fast"]) == 2
    assert "unknown mode 'fast'" in capsys.readouterr().err
    (tmp_path / "run/timeline/controller.jsonl").write_text(
        '{"e":"start","t":0,"num_steps":1,"batch_size":4}\n{bad\n{"e":1}\n'
    )
    with pytest.raises(UsageError, match="controller.jsonl:2: not a JSON line"):
        calibrate(tmp_path / "run", 1)
