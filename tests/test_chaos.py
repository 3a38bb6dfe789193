"""`launch.py chaos`: seeded fault plans, refused configs, a store on a disk that refuses writes, and
(slow) real tiny runs with injected faults that must finish with no trajectory lost or trained twice."""

import json
import os
import random
import resource
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from test_store_trajectories import make_traj

from rollart_hpc.chaos import trials as chaos
from rollart_hpc.rollout.resilient import (
    ENGINE_FAULT_SIGNAL,
    FaultInjector,
    InjectedEngineError,
    arm_fault_signal,
)
from rollart_hpc.store.trajectories import TrajectoryStore, committed, read_store

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.toml"


def _setup(*overrides):
    return chaos.make_setup(TINY, overrides, 3, 900.0)


def test_fault_plans_follow_the_seed_and_cover_every_rank_role():
    setup = _setup()
    assert setup.roles == {0: "controller", 1: "rollout", 2: "env", 3: "reward", 4: "trainer"}
    plans = [chaos.plan_fault(random.Random(7), setup, "kill") for _ in range(2)]
    assert plans[0] == plans[1]
    rng = random.Random(1)
    many = [chaos.plan_fault(rng, setup, "stop") for _ in range(60)]
    assert {p.rank for p in many} == set(range(5))
    assert all(1 <= p.after_steps <= setup.num_steps - 2 and p.role == setup.roles[p.rank] for p in many)


def test_each_round_has_every_kind_once_and_disk_and_engine_hit_only_their_roles():
    setup = _setup()
    plans = chaos.plan_trials(random.Random(3), setup, 10 * len(chaos.FAULTS))
    assert plans == chaos.plan_trials(random.Random(3), setup, 10 * len(chaos.FAULTS))
    assert set(chaos.FAULTS) == {"kill", "stop", "checkpoint", "disk", "engine"}
    for start in range(0, len(plans), len(chaos.FAULTS)):
        assert sorted(p.fault for p in plans[start : start + len(chaos.FAULTS)]) == sorted(chaos.FAULTS)
    roles = Counter((p.fault, p.role) for p in plans)
    assert {role for fault, role in roles if fault == "disk"} == {"controller", "trainer"}
    assert {role for fault, role in roles if fault == "engine"} == {"rollout"}
    assert {role for fault, role in roles if fault == "kill"} <= set(setup.roles.values())


# A writer whose disk refuses writes: each write raises and nothing more is committed. (In a child: the
# HDF5 library of a process whose file could not be flushed may crash as the process exits.)
FAILING_WRITER = """
import resource, sys
sys.path.insert(0, sys.argv[2])
from test_store_trajectories import make_traj
from rollart_hpc.store.trajectories import TrajectoryStore
store = TrajectoryStore(sys.argv[1])
limit = (store.path.stat().st_size // 2, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
resource.setrlimit(resource.RLIMIT_FSIZE, limit)  # Python ignores SIGXFSZ: writes fail with EFBIG
for write in (lambda: store.append([make_traj(i) for i in range(4, 8)], [1.0] * 4),
              lambda: store.mark(["ep-000001"], "trained", 1)):
    try:
        write()
        print("written", flush=True)
    except RuntimeError as exc:
        print("raised", "File too large" in str(exc), flush=True)
print(store.position(), flush=True)
"""


def test_a_store_on_a_disk_that_refuses_writes_raises_before_committing_and_reopens(tmp_path):
    path = tmp_path / "trajectories.h5"
    with TrajectoryStore(path) as store:
        store.append([make_traj(i) for i in range(4)], [1.0] * 4)
        store.mark(["ep-000000"], "trained", 1)
        before = store.position()
    child = subprocess.run(
        [sys.executable, "-c", FAILING_WRITER, str(path), str(REPO / "tests")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.stdout.splitlines() == ["raised True", "raised True", str(before)], child.stderr[-2000:]
    assert committed(path) == before
    with TrajectoryStore(path) as reopened:  # the writer died: the file is rebuilt from its commit
        assert reopened.position() == before
        reopened.append([make_traj(i) for i in range(4, 8)], [1.0] * 4)
        reopened.mark(["ep-000001"], "trained", 2)
    records = read_store(path).records
    assert [r.episode_id for r in records] == [f"ep-{i:06d}" for i in range(8)]
    assert [r.final_status for r in records[:3]] == ["trained", "trained", "pending"]


def test_a_config_without_an_older_checkpoint_to_fall_back_to_is_refused():
    with pytest.raises(chaos.UsageError, match="keep_checkpoints >= 2"):
        _setup("controller.keep_checkpoints=1")
    with pytest.raises(chaos.UsageError, match="max_engine_rebuilds >= 1"):
        _setup("rollout.max_engine_rebuilds=0")


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_disk_fault_limits_a_writer_to_half_its_largest_file(tmp_path, sleeper):
    part = tmp_path / "checkpoints" / "step-000002" / "trainer"
    part.mkdir(parents=True)
    (part / "__0_0.distcp").write_bytes(b"x" * 3000)
    (part / "common.pt").write_bytes(b"x" * 100)
    (part.parent / "COMPLETE").write_text("{}")
    detail = chaos.limit_file_size(sleeper, "trainer", tmp_path)
    assert detail == "RLIMIT_FSIZE 1500 bytes (half of checkpoints/step-000002/trainer/__0_0.distcp)"
    assert resource.prlimit(sleeper, resource.RLIMIT_FSIZE) == (1500, 1500)
    (tmp_path / "trajectories.h5").write_bytes(b"x" * 1000)  # (a limit only goes down)
    assert "RLIMIT_FSIZE 500 bytes" in chaos.limit_file_size(sleeper, "controller", tmp_path)
    assert resource.prlimit(sleeper, resource.RLIMIT_FSIZE) == (500, 500)


@pytest.fixture
def engine_fault_handler():
    previous = signal.getsignal(ENGINE_FAULT_SIGNAL)
    yield
    signal.signal(ENGINE_FAULT_SIGNAL, previous)


def test_the_engine_fault_signal_fails_the_next_step_once(engine_fault_handler):
    faults = FaultInjector(0.0, 0, seed=0)
    arm_fault_signal(faults)
    faults.check()
    assert chaos.fail_engine(os.getpid(), "builtin").startswith("SIGRTMIN+1")
    with pytest.raises(InjectedEngineError, match="requested by signal"):
        faults.check()
    faults.check()  # once only


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_trials_survive_with_nothing_lost_or_trained_twice(tmp_path):
    # seed 25: a damaged checkpoint (+ SIGKILL of the controller), then a SIGSTOPped trainer
    result, stdout = _chaos(tmp_path, "25")
    assert [row["fault"] for row in result["rows"]] == ["checkpoint", "stop"]
    assert (result["trials"], result["survived"], result["lost"], result["duplicated"]) == (2, 2, 0, 0)
    for row in result["rows"]:
        assert row["injected"] and row["restarts"] >= 1 and row["recovery_s"] > 0, row
        assert row["steps_redone"] >= 0 and row["accounting"]["trained"] == 8 * 4, row
    assert "survived 2" in stdout


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_full_disk_and_a_dead_engine_are_survived(tmp_path):
    # seed 18: the controller's disk refuses writes to the store (restart), then the rollout rank's
    # engine fails (rebuilt in place, no restart)
    result, stdout = _chaos(tmp_path, "18")
    assert (result["trials"], result["survived"], result["lost"], result["duplicated"]) == (2, 2, 0, 0)
    disk, engine = result["rows"]
    assert (disk["fault"], disk["role"], engine["fault"], engine["role"]) == (
        "disk",
        "controller",
        "engine",
        "rollout",
    )
    assert disk["restarts"] >= 1 and disk["recovery_s"] > 0 and "RLIMIT_FSIZE" in disk["detail"], disk
    assert engine["restarts"] == 0 and engine["rebuilds"] >= 1 and engine["steps_redone"] == 0, engine
    assert engine["recovery_s"] > 0 and engine["accounting"]["failed"] >= 1, engine
    for row in result["rows"]:
        assert row["accounting"]["trained"] == 8 * 4, row
    assert "survived 2" in stdout


def _chaos(tmp_path, seed):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "chaos", str(TINY), "cluster.peer_timeout_s=30",
         "--trials", "2", "--seed", seed, "--json", str(out),
         "--work-dir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=1400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_fraction_of_a_step_is_measured_on_the_run_clock():
    assert chaos.last_step_s([{"wall_s": 4.0}, {"wall_s": 4.5}]) == 0.5
    assert chaos.last_step_s([{"wall_s": 0.8}]) == 0.8
    assert chaos.last_step_s([{"wall_s": 1.0}, {"wall_s": 99.0}]) == 10.0
    assert chaos.last_step_s([{"version": 1}]) == 1.0


def test_the_command_refuses_bad_counts_in_one_line(tmp_path, capsys):
    from rollart_hpc.entry.cli import main as cli_main

    argv = ["chaos", str(TINY), "--json", str(tmp_path / "x.json"), "--work-dir", str(tmp_path / "w")]
    assert cli_main([*argv, "--trials", "0"]) == 2
    assert cli_main([*argv, "--max-restarts", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --trials and --max-restarts must be >= 1"] * 2, err
    assert not (tmp_path / "w").exists()
