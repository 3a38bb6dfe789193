"""Every example under examples/ runs to the end with the tiny model, and its metrics carry its family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.mpi, pytest.mark.slow]
EXAMPLES = {"wordle": "wordle", "jsonl_tasks": "trivia", "gym_text": "guess", "openai_agent": "arith"}


@pytest.mark.parametrize(("example", "family"), sorted(EXAMPLES.items()))
def test_example_runs_to_the_end_with_its_family_in_the_metrics(tmp_path, example, family):
    run_dir = tmp_path / example
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "launch.py"),
            "run",
            f"examples/{example}/config.toml",
            "--run-dir",
            str(run_dir),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and f"train_success/{family}" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(r["count/failed"] == 0 for r in steps)  # every episode played and scored
