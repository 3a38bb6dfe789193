"""The resource planner: ranked splits from the CLI, `--write` round trip through `plan --memory`, and
one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart_hpc.config import load_config
from rollart_hpc.entry import cli
from rollart_hpc.sim.resources import BOUNDS

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs/gpu_2pools.toml")
MODEL = str(REPO / "configs/models/qwen2.5-7b/config.json")
SMALL = ["controller.batch_size=16", "envs.num_slots=32"]


def test_resources_ranks_splits_and_writes_a_config_plan_memory_accepts(tmp_path, capsys):
    out = tmp_path / "split.toml"
    code = cli.main(["plan", CONFIG, *SMALL, "--resources", "--gpus", "24", "--hardware", "h800:16,h20:8",
                     "--model", MODEL, "--write", str(out), "--top", "3"])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    ranked = [line for line in text.splitlines() if line[:3] in ("1. ", "2. ", "3. ")]
    assert len(ranked) == 3
    rates = [float(line.split(" traj/s")[0].rsplit("| ", 1)[1]) for line in ranked]
    assert rates == sorted(rates, reverse=True)
    assert "compute=" in ranked[0] and "bandwidth=" in ranked[0] and "busy trainer=" in ranked[0]
    written = load_config(out)
    pools = {p.name: p for p in written.roles.pools()}
    trainer = written.roles.trainer
    assert trainer.num_ranks + sum(p.num_ranks for p in pools.values()) == 24
    assert pools["bandwidth"].gpu_type == "h20" and pools["bandwidth"].num_ranks == 8
    assert written.controller.mode == "async" and written.controller.max_staleness in BOUNDS
    assert cli.main(["plan", str(out), "--memory"]) == 0  # every rank fits its GPU


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hardware", "h900:8"], "unknown GPU 'h900'"),
        (["--hardware", "h800:x"], "must be an integer"),
        (["--hardware", "h800:8,h20"], "give every type a count"),
        (["--gpus", "20", "--hardware", "h800:8,h20:8"], "sums to 16"),
    ],
)
def test_resources_bad_input_is_one_line(argv, message, capsys):
    assert cli.main(["plan", CONFIG, "--resources", "--model", MODEL, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_write_without_resources_is_refused(capsys):
    assert cli.main(["plan", CONFIG, "--write", "x.toml"]) == 2
    assert "--resources" in capsys.readouterr().err


def test_resources_takes_the_workload_from_a_measured_run(tmp_path, capsys):
    from tests.test_simulate import traced_run

    run_dir = tmp_path / "cal"
    traced_run(run_dir)
    code = cli.main(["plan", CONFIG, *SMALL, "--resources", "--hardware", "h800:16", "--model", MODEL,
                     "--calibrate", str(run_dir), "--top", "2"])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert f"episodes measured in {run_dir}" in text
    assert "1. trainer 8 h800" in text and "compute=h800x8" in text


def test_resources_splits_cpu_ranks_from_a_measured_run(tmp_path, capsys):
    from tests.test_simulate import traced_run

    run_dir, out = tmp_path / "cal", tmp_path / "split.toml"
    traced_run(run_dir)
    tiny = str(REPO / "configs/tiny.toml")
    code = cli.main(["plan", tiny, "--resources", "--ranks", "4", "--calibrate", str(run_dir),
                     "--write", str(out)])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    ranked = [line for line in text.splitlines() if line[:3] in ("1. ", "2. ", "3. ")]
    assert len(ranked) == 3  # 2/1/1, 1/2/1, 1/1/2
    rates = [float(line.split(" traj/s")[0].rsplit("| ", 1)[1]) for line in ranked]
    assert rates == sorted(rates, reverse=True)
    assert "the config's split: rollout 1 | env 1 | trainer 1" in text
    roles = load_config(out).roles
    assert roles.rollout.num_ranks + roles.env.num_ranks + roles.trainer.num_ranks == 4
    assert f"rollout {roles.rollout.num_ranks} | env {roles.env.num_ranks} | trainer" in ranked[0]


def test_cpu_ranks_need_a_measured_run(capsys):
    assert cli.main(["plan", str(REPO / "configs/tiny.toml"), "--resources", "--ranks", "4"]) == 2
    assert "--calibrate" in capsys.readouterr().err
