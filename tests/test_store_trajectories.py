"""HDF5 trajectory store: round trip, status resolution, concurrent SWMR reader, crash, truncate."""

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from launching import wait_until

from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.store.trajectories import StorePosition, TrajectoryStore, committed, read_store

TESTS = Path(__file__).resolve().parent


def make_traj(i: int, failed: bool = False) -> Trajectory:
    """Deterministic trajectory number `i`: contents can be recomputed to check what was stored."""
    traj = Trajectory(f"task-{i % 5}", "calc" if i % 2 else "household", ("cpu", f"t{i % 3}"), f"ep-{i:06d}")
    traj.dispatch = {"version": i // 4, "dispatch_time": 1000.0 + i, "baseline": 0.25, "event": i}
    traj.append(list(range(i % 7 + 3)), False, [], [])
    for turn in range(i % 3 + 1):
        n = (i + turn) % 5 + 1
        traj.append(
            [100 + i + k for k in range(n)], True, [-0.5 * (k + 1) / (i + 1) for k in range(n)], [i // 4] * n
        )
        traj.append([7, 8], False, [], [])
        traj.actions.append(f"act {turn} é")
        traj.llm_s.append(0.1)
        traj.env_s.append(0.01)
    traj.num_turns = len(traj.actions)
    if failed:
        traj.status, traj.finish_cause, traj.error = "failed", "timeout", "env timed out ✓ " * 60
    else:
        traj.finish_cause, traj.reward, traj.success = "done", float(i % 2), bool(i % 2)
    return traj


def check_record(rec, i: int) -> None:
    traj = make_traj(i, failed=rec.traj_status == "failed")
    assert rec.episode_id == traj.episode_id and rec.task_id == traj.task_id and rec.family == traj.family
    assert rec.tags == traj.tags and rec.num_turns == traj.num_turns and rec.dispatch == traj.dispatch
    assert rec.token_ids.tolist() == traj.token_ids and rec.action_mask.tolist() == traj.action_mask
    assert rec.versions.tolist() == traj.versions
    np.testing.assert_array_equal(rec.logprobs, np.asarray(traj.logprobs, dtype=np.float32))
    assert rec.reward == traj.reward and rec.success == traj.success
    assert rec.dispatch_version == i // 4 and rec.dispatch_time == 1000.0 + i


def writer_main(path: str, start: int, count: int, batch: int, ready: str, pause_file: str) -> None:
    """Subprocess body: append `count` trajectories in batches; touch `ready` after the first batch and,
    when `pause_file` is given, wait for it to vanish before each later batch."""
    with TrajectoryStore(path) as store:
        for first in range(start, start + count, batch):
            ids = range(first, min(first + batch, start + count))
            store.append([make_traj(i) for i in ids], [2000.0 + i for i in ids])
            Path(ready).write_text(str(store.position().rows))
            while pause_file and Path(pause_file).exists():
                time.sleep(0.01)
            if pause_file:
                Path(pause_file).write_text("wait")


def start_writer(path, start, count, batch, ready, pause_file=""):
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from test_store_trajectories import writer_main; " \
           f"writer_main({str(path)!r}, {start}, {count}, {batch}, {str(ready)!r}, {str(pause_file)!r})"  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", code])


def test_round_trip_and_status_resolution(tmp_path):
    path = tmp_path / "traj.h5"
    with TrajectoryStore(path) as store:
        store.append([make_traj(i) for i in range(6)], [2000.0 + i for i in range(6)])
        pos = store.append([make_traj(6, failed=True), make_traj(7)], [2006.0, 2007.0])
        assert pos.rows == 8 and pos.events == 0
        assert pos.tokens == sum(len(make_traj(i).token_ids) for i in range(8))
        store.mark(["ep-000000", "ep-000001"], "trained", 3)
        store.mark(["ep-000002"], "dropped", 3, "stale")
        store.mark(["ep-000006"], "failed", -1, "timeout")
        store.mark(["ep-000000"], "dropped", 4, "duplicate")  # a later event wins
        with pytest.raises(KeyError):
            store.mark(["ep-999999"], "trained", 1)
        with pytest.raises(ValueError, match="needs a cause"):
            store.mark(["ep-000003"], "dropped", 1)
        with pytest.raises(ValueError, match="already stored"):
            store.append([make_traj(1)], [0.0])
    contents = read_store(path)
    assert contents.position == StorePosition(8, pos.tokens, 5)
    for i, rec in enumerate(contents.records):
        check_record(rec, i)
    statuses = [(r.final_status, r.final_version, r.final_cause) for r in contents.records]
    assert statuses[:3] == [("dropped", 4, "duplicate"), ("trained", 3, ""), ("dropped", 3, "stale")]
    assert statuses[6] == ("failed", -1, "timeout") and statuses[7] == ("pending", -1, "")
    failed = contents.records[6]
    assert failed.traj_status == "failed" and failed.finish_cause == "timeout"
    assert 0 < len(failed.error.encode()) <= 512 and failed.error.startswith("env timed out ✓")
    assert contents.summary() == {
        "num_trajectories": 8,
        "by_status": {"dropped": 2, "trained": 1, "failed": 1, "pending": 4},
        "by_cause": {"dropped:duplicate": 1, "dropped:stale": 1, "failed:timeout": 1},
    }


def test_reopen_continues_and_second_writer_is_refused(tmp_path):
    path = tmp_path / "traj.h5"
    with TrajectoryStore(path) as store:
        store.append([make_traj(0)], [1.0])
        with pytest.raises(RuntimeError, match="another writer"):
            TrajectoryStore(path)
    with TrajectoryStore(path) as store:
        store.append([make_traj(1)], [2.0])
        store.mark(["ep-000000"], "trained", 0)
    contents = read_store(path)
    assert [r.episode_id for r in contents.records] == ["ep-000000", "ep-000001"]
    assert contents.records[0].final_status == "trained"


def test_concurrent_reader_process_sees_new_rows(tmp_path):
    path, ready, pause = tmp_path / "traj.h5", tmp_path / "ready", tmp_path / "pause"
    pause.write_text("wait")
    proc = start_writer(path, 0, 30, 10, ready, pause)
    try:
        seen = []
        for expected in (10, 20, 30):
            wait_until(lambda e=expected: ready.exists() and ready.read_text() == str(e), 60, 0.02)
            contents = read_store(path)  # this test process reads while the writer process holds the file
            seen.append(contents.position.rows)
            for i, rec in enumerate(contents.records):
                check_record(rec, i)
            with h5py.File(path, "r", swmr=True) as f:  # plain h5py, as any analysis script would
                assert f["commit"][0] == expected
            pause.unlink()
            wait_until(lambda: pause.exists() or proc.poll() is not None, 60, 0.02)
        assert seen == [10, 20, 30]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_crash_keeps_committed_rows_and_store_continues(tmp_path):
    path, ready = tmp_path / "traj.h5", tmp_path / "ready"
    proc = start_writer(path, 0, 100_000, 3, ready)
    try:
        wait_until(lambda: ready.exists() and int(ready.read_text() or 0) >= 30, 60, 0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    before = committed(path).rows
    assert before >= 30
    with TrajectoryStore(path) as store:  # reopening after the crash rebuilds from the committed counts
        assert store.position().rows == before
        store.append([make_traj(before)], [0.0])
        store.mark([f"ep-{before:06d}"], "trained", 9)
    contents = read_store(path)
    assert contents.position.rows == before + 1
    for i, rec in enumerate(contents.records):
        check_record(rec, i)
    assert contents.records[-1].final_status == "trained"


def test_truncate_to_checkpointed_position(tmp_path):
    path = tmp_path / "traj.h5"
    with TrajectoryStore(path) as store:
        store.append([make_traj(i) for i in range(3)], [0.0] * 3)
        store.mark(["ep-000000"], "trained", 1)
        checkpoint = store.position()
        store.append([make_traj(i) for i in range(3, 6)], [0.0] * 3)
        store.mark(["ep-000001", "ep-000004"], "dropped", 2, "stale")
        with pytest.raises(ValueError, match="beyond"):
            store.truncate_to(StorePosition(10, 0, 0))
        store.truncate_to(checkpoint)
        assert store.position() == checkpoint
        store.append([make_traj(3)], [0.0])  # the resumed run writes the same episode again
    contents = read_store(path)
    assert [r.episode_id for r in contents.records] == [f"ep-{i:06d}" for i in range(4)]
    assert [r.final_status for r in contents.records] == ["trained", "pending", "pending", "pending"]
    for i, rec in enumerate(contents.records):
        check_record(rec, i)


@pytest.mark.skipif(shutil.which("h5dump") is None, reason="h5dump (hdf5-tools) not installed")
def test_h5dump_reads_the_store(tmp_path):
    path = tmp_path / "traj.h5"
    with TrajectoryStore(path) as store:
        store.append([make_traj(0), make_traj(1)], [1.0, 2.0])
    out = subprocess.run(
        ["h5dump", "-d", "/trajectories/episode_id", str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "ep-000000" in out.stdout and "ep-000001" in out.stdout and "H5T_CSET_UTF8" in out.stdout
    assert not math.isnan(read_store(path).records[0].dispatch_time)
