"""A tiny RL run whose rollout engine fails twice (injected) and whose reward calls fail at random: the
engine is rebuilt in place, the requests it held end as failed episodes (llm_error), the accounting
balances and summary.json reports the failures and rebuilds per rank."""

from collections import defaultdict

import pytest
from launching import run, settled_summary, stored_records

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_failed_engines_are_rebuilt_in_place_and_accounted(tmp_path):
    run_dir = run(
        tmp_path / "rebuild",
        "rollout.fault_step_prob=0.2",
        "rollout.num_faults=2",
        "reward.fault_prob=0.3",
        "reward.max_score_attempts=2",
        "controller.max_staleness=1",
    )
    summary = settled_summary(run_dir)
    acc = summary["accounting"]
    counts = summary["failures_and_rebuilds"]
    (rollout,) = [v for k, v in counts.items() if k.startswith("rollout")]
    (reward,) = [v for k, v in counts.items() if k.startswith("reward")]
    assert rollout == {"failures": 2, "rebuilds": 2}
    assert reward["failures"] >= 1 and reward["rebuilds"] == 0
    assert acc["failed"].get("llm_error", 0) >= 2 and acc["trained"] == 3 * 4
    by_cause = defaultdict(int)
    for r in stored_records(run_dir):
        if r.final_status == "failed":
            by_cause[r.final_cause] += 1
        if r.final_status == "trained":
            generated = [v for v, m in zip(r.versions, r.action_mask, strict=True) if m]
            assert r.final_version - min(generated) <= 1
    assert dict(by_cause) == acc["failed"]
    for versions in summary["rollout_versions"].values():  # the last version may land after STOP
        assert versions == sorted(versions) and versions[-1] >= 2
