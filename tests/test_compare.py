"""`launch.py compare`: synthetic metrics.jsonl files with known curves -> areas, finals, intervals, paired
differences, JSON keys, the PNG and the markdown table; corrupt lines, runs without eval rows, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollart_hpc.entry.cli import main as cli_main
from rollart_hpc.sweep import compare


def _rows(train: list[float], evals: dict[int, float]) -> list[dict[str, Any]]:
    """Rows as the controller writes them: step s trains version s + 1; an evaluation round of version v is
    a row `kind = "eval"` with `step` = `version` = v (here after the train row that made v)."""
    rows: list[dict[str, Any]] = []
    if 0 in evals:
        rows.append({"kind": "eval", "step": 0, "version": 0, "eval_success": evals[0]})
    for step, success in enumerate(train):
        row = {
            "step": step,
            "version": step + 1,
            "wall_s": 2.0 * (step + 1),
            "count/trained": 4 * (step + 1),
            "train_success": success,
        }
        rows.append(row)
        if step + 1 in evals:
            value = evals[step + 1]
            rows.append(
                {
                    "kind": "eval",
                    "step": step + 1,
                    "version": step + 1,
                    "eval_success": value,
                    "eval_success/x": value,
                }
            )
    return rows


def _write(run_dir: Path, rows: list[dict[str, Any]], extra_lines: tuple[str, ...] = ()) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _sweep(tmp_path: Path) -> Path:
    """Arm A: eval 0 -> 0.5 -> 1 at steps 0, 2, 4 (area 0.5, final 1) + seed offsets; arm B: 0.2 higher."""
    out = tmp_path / "sweep"
    runs = []
    for arm, shift in (("algo.rho=0.8", 0.0), ("algo.rho=0.9", 0.2)):
        for seed, offset in ((0, -0.1), (1, 0.0), (2, 0.1)):
            evals = {0: 0.0 + offset + shift, 2: 0.5 + offset + shift, 4: 1.0 + offset + shift}
            _write(out / arm / f"seed={seed}", _rows([0.1] * 5, evals))
            runs.append(
                {"name": f"{arm}/seed={seed}", "arm": arm, "seed": seed, "run_dir": f"{arm}/seed={seed}"}
            )
    (out / "sweep.json").write_text(json.dumps({"runs": runs}))
    return out


def test_every_other_series_gets_its_area_and_paired_difference(tmp_path: Path) -> None:
    """train_success (the paper's training-reward area) and the eval rows' per-family series: arm A's
    eval_success/x is 0.5, 1.0 (+ seed offset) at steps 2 and 4 (area 0.75), arm B's 0.2 higher."""
    out = _sweep(tmp_path)
    js = tmp_path / "c.json"
    assert cli_main(["compare", str(out), "--json", str(js), "--resamples", "500"]) == 0
    arms = json.loads(js.read_text())["arms"]
    a, b = arms["algo.rho=0.8"]["series"], arms["algo.rho=0.9"]["series"]
    assert set(a) == set(b) == {"train_success", "eval_success/x"}
    assert a["train_success"]["area"]["mean"] == pytest.approx(0.1)
    assert b["train_success"]["area_diff_vs_reference"]["mean"] == pytest.approx(0.0)
    assert a["eval_success/x"]["area"]["mean"] == pytest.approx(0.75)
    assert b["eval_success/x"]["area"]["mean"] == pytest.approx(0.95)
    assert b["eval_success/x"]["area_diff_vs_reference"] == pytest.approx(
        {"mean": 0.2, "ci_low": 0.2, "ci_high": 0.2, "n": 3}
    )
    table = (out / compare.COMPARE_MD).read_text()
    assert "| algo.rho=0.9 | eval_success/x | 0.950 [" in table and "| 0.200 [0.200, 0.200] |" in table


def test_known_means_intervals_and_paired_differences(tmp_path: Path) -> None:
    out = _sweep(tmp_path)
    png, js = tmp_path / "plots" / "c.png", tmp_path / "c.json"
    assert cli_main(["compare", str(out), "--json", str(js), "--png", str(png), "--resamples", "2000"]) == 0
    result = json.loads(js.read_text())
    assert result["reference"] == "algo.rho=0.8"
    a, b = result["arms"]["algo.rho=0.8"], result["arms"]["algo.rho=0.9"]
    for key in ("area_eval_success", "final_eval_success"):
        assert set(a[key]) == {"mean", "ci_low", "ci_high", "n"} and a[key]["n"] == 3
        assert a[key]["ci_low"] <= a[key]["mean"] <= a[key]["ci_high"]
    assert a["area_eval_success"]["mean"] == pytest.approx(0.5)
    assert a["final_eval_success"]["mean"] == pytest.approx(1.0)
    assert b["area_eval_success"]["mean"] == pytest.approx(0.7)
    assert a["area_eval_success"]["ci_low"] == pytest.approx(0.4, abs=1e-9)  # all three seeds at -0.1
    assert a["area_eval_success"]["ci_high"] == pytest.approx(0.6, abs=1e-9)
    diff = b["area_eval_success_diff_vs_reference"]
    assert diff["mean"] == pytest.approx(0.2) and diff["ci_low"] == pytest.approx(0.2) and diff["n"] == 3
    assert a["area_eval_success_diff_vs_reference"]["mean"] == 0.0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    table = (out / "compare.md").read_text()
    assert "| algo.rho=0.9 | 0,1,2 | 0.700 [" in table and "(ref)" in table
    assert "train_success used instead" not in table


def test_reference_arm_and_final_window(tmp_path: Path) -> None:
    out = _sweep(tmp_path)
    js = tmp_path / "c.json"
    argv = ["compare", str(out), "--json", str(js), "--reference", "algo.rho=0.9", "--final-window", "2"]
    assert cli_main(argv) == 0
    result = json.loads(js.read_text())
    a = result["arms"]["algo.rho=0.8"]
    assert a["final_eval_success"]["mean"] == pytest.approx(0.75)
    assert a["final_eval_success_diff_vs_reference"]["mean"] == pytest.approx(-0.2)


def test_bootstrap_is_seeded_and_contains_the_mean() -> None:
    values = [0.1, 0.4, 0.35, 0.8, 0.6]
    first, second = compare.bootstrap(values, 10_000, 0), compare.bootstrap(values, 10_000, 0)
    assert first == second
    assert first.mean == pytest.approx(0.45) and first.ci_low < first.mean < first.ci_high
    assert compare.bootstrap([0.3], 100, 0).as_dict() == {"mean": 0.3, "ci_low": 0.3, "ci_high": 0.3, "n": 1}


def test_area_is_the_mean_success_over_the_step_range() -> None:
    points = [{"step": s, "success": v} for s, v in ((10, 0.0), (20, 1.0), (40, 1.0))]
    assert compare.area(points) == pytest.approx((5 + 20) / 30)
    assert compare.area(points[:1]) == 0.0


def test_corrupt_lines_warn_and_runs_without_eval_fall_back_to_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s"
    _write(out / "x" / "seed=0", _rows([0.0, 0.5, 1.0], {}), ('{"step": 3, "train_su', "not json"))
    _write(out / "x" / "seed=1", _rows([0.0, 1.0], {}))
    (out / "empty" / "seed=0").mkdir(parents=True)
    (out / "empty" / "seed=0" / "metrics.jsonl").write_text("garbage\n")
    js = tmp_path / "c.json"
    assert cli_main(["compare", str(out), "--json", str(js)]) == 0
    captured = capsys.readouterr()
    path = out / "x" / "seed=0" / "metrics.jsonl"
    assert f"warning: {path}:4: corrupt metrics line skipped" in captured.err
    assert f"warning: {path}:5: corrupt metrics line skipped" in captured.err
    assert "no metrics rows; run empty/seed=0 left out" in captured.err
    arm = json.loads(js.read_text())["arms"]["x"]
    assert arm["eval_from_train"] == [0, 1] and arm["area_eval_success"]["mean"] == pytest.approx(0.5)
    assert "train_success used instead: x seeds [0, 1]" in captured.out
    assert (out / "compare.png").exists()


def test_empty_dir_and_unknown_reference_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no run with metrics rows" in err and err.count("\n") == 1
    out = _sweep(tmp_path)
    assert cli_main(["compare", str(out), "--reference", "nope"]) == 2
    assert "not an arm" in capsys.readouterr().err


def test_eval_points_sit_at_their_version_with_the_trained_count_and_time_that_made_it() -> None:
    run = compare.curves("r", "a", 0, _rows([0.1] * 5, {0: 0.0, 2: 0.5, 4: 1.0}))
    assert [(p["step"], p["trained"], p["wall_s"]) for p in run.evals] == [
        (0, 0, 0),
        (2, 8, 4.0),
        (4, 16, 8.0),
    ]
    assert [p["step"] for p in run.train] == [0, 1, 2, 3, 4] and not run.eval_from_train
