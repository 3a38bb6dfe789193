"""`launch.py chaos`: seeded fault plans, refused configs, and (slow) real tiny runs with injected faults
that must finish with no trajectory lost or trained twice."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rollart_hpc.entry import chaos

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.toml"


def _setup(*overrides):
    parser = chaos.argparse.ArgumentParser()
    chaos.add_arguments(parser)
    return chaos.make_setup(parser.parse_args([str(TINY), *overrides, "--json", "x.json"]))


def test_fault_plans_follow_the_seed_and_cover_every_rank_role():
    setup = _setup()
    assert setup.roles == {0: "controller", 1: "rollout", 2: "env", 3: "reward", 4: "trainer"}
    plans = [chaos.plan_fault(random.Random(7), setup, "kill") for _ in range(2)]
    assert plans[0] == plans[1]
    rng = random.Random(1)
    many = [chaos.plan_fault(rng, setup, "stop") for _ in range(60)]
    assert {p.rank for p in many} == set(range(5))
    assert all(1 <= p.after_steps <= setup.num_steps - 2 and p.role == setup.roles[p.rank] for p in many)


def test_a_config_without_an_older_checkpoint_to_fall_back_to_is_refused():
    with pytest.raises(chaos.UsageError, match="keep_checkpoints >= 2"):
        _setup("controller.keep_checkpoints=1")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_trials_survive_with_nothing_lost_or_trained_twice(tmp_path):
    # seed 4: a damaged checkpoint (+ SIGKILL of the reward rank), then a SIGSTOPped controller
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "chaos", str(TINY), "cluster.peer_timeout_s=30",
         "--trials", "2", "--seed", "4", "--json", str(out),
         "--work-dir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=1400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["trials"], result["survived"], result["lost"], result["duplicated"]) == (2, 2, 0, 0)
    for row in result["rows"]:
        assert row["injected"] and row["restarts"] >= 1 and row["recovery_s"] > 0, row
        assert row["steps_redone"] >= 0 and row["accounting"]["trained"] == 8 * 4, row
    assert "survived 2" in proc.stdout
