"""Two rollout pools in a real MPI world: turns follow the family-to-pool map while the pool has room and
fall back to the other pool only while every rank of their own is saturated; with redundancy on, every
dispatched trajectory is still accounted for, and each one dropped as redundant is logged."""

import json
from collections import Counter
from pathlib import Path

import pytest
from launching import run, settled_summary, stored_records

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

POOLS = '[{name="a", num_ranks=1, num_slots=1}, {name="b", num_ranks=1, num_slots=8}]'


def test_family_map_with_fallback_and_redundancy(tmp_path: Path) -> None:
    run_dir = tmp_path / "pools"
    overrides = [
        'envs.families=["calc_math", "frozenlake"]',
        "envs.num_tasks={calc_math=12, frozenlake=8}",
        f"roles.rollout_pools={POOLS}",
        "routing.policy=static",
        'routing.families={calc_math="a", frozenlake="b"}',
        "controller.redundancy=1.5",
    ]
    run(run_dir, *overrides)

    report = json.loads((run_dir / "routing" / "env-3.json").read_text())
    pools = report["pools"]
    assert report["policy"] == "static" and pools["a"]["requests_calc_math"] > 0
    assert pools["b"]["requests_frozenlake"] > 0
    # every turn off its family's pool is a counted fallback, and pool a (1 slot) did saturate
    assert pools["b"].get("requests_calc_math", 0) == pools["a"].get("fallbacks_out_calc_math", 0) >= 1
    assert pools["a"].get("requests_frozenlake", 0) == pools["b"].get("fallbacks_out_frozenlake", 0)
    for event in report["fallback_events"]:
        assert all(n >= event["from_slots"] for n in event["from_requests"].values()), event

    summary = settled_summary(run_dir)
    acc = summary["accounting"]
    records = stored_records(run_dir)
    assert len(records) == acc["dispatched"] and acc["trained"] == 12
    statuses = Counter((r.final_status, r.final_cause) for r in records)
    assert statuses[("trained", "")] == 12
    assert statuses[("dropped", "redundant")] == acc["dropped"].get("redundant", 0)
    logged = (run_dir / "redundant.jsonl").read_text().splitlines() if acc["dropped"].get("redundant") else []
    assert len(logged) == acc["dropped"].get("redundant", 0)
    for line in logged:
        assert {"task_id", "tokens", "reward_so_far", "when"} <= set(json.loads(line))
