"""Every example under examples/ runs to the end with the tiny model, and its metrics carry its family."""

from __future__ import annotations

import pytest
from launching import metric_rows, run

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
EXAMPLES = {"wordle": "wordle", "jsonl_tasks": "trivia", "gym_text": "guess", "openai_agent": "arith"}


@pytest.mark.parametrize(("example", "family"), sorted(EXAMPLES.items()))
def test_example_runs_to_the_end_with_its_family_in_the_metrics(tmp_path, example, family):
    run_dir = run(tmp_path / example, config=f"examples/{example}/config.toml")
    rows = metric_rows(run_dir)
    steps = [r for r in rows if "step" in r and f"train_success/{family}" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(r["count/failed"] == 0 for r in steps)  # every episode played and scored
