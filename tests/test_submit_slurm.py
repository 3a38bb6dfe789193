"""`launch.py submit` on the local SLURM test cluster (start it with `bash slurm/up.sh`).

The smoke job runs as a real heterogeneous job (rollout roles on node rollout1, the trainer on train1)
and through submitit on the `all` partition over both nodes. Each rank records its node
(`pids/rank-<r>.pid`, from SLURMD_NODENAME) and logs "<role> rank <r> ok". Run dirs have spaces and
quotes. Every wait is bounded, and a job still queued when its test ends is cancelled.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from slurm_logs import job_log, query, rank_nodes, settled_states, step_succeeded

from rollart_hpc.cluster.jobs import JOB_RECORD
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry import submit

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(shutil.which("sinfo") is None, reason="sinfo not on PATH: no SLURM client installed"),
]

JOB_TIMEOUT_S = 240.0
ROLES = ("controller", "rollout", "env", "reward", "trainer")


@pytest.fixture(autouse=True)
def _controller_up() -> None:
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30, check=False)
    assert "is UP" in ping.stdout, f"slurmctld is not up (start it with slurm/up.sh): {ping.stdout.strip()}"


def _submit(repo_root: Path, run_dir: Path, overrides: list[str], *options: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    config = str(repo_root / "configs" / "smoke.toml")
    # The peer timeout covers torch's import on every rank: generous, since this 2-core host is shared.
    overrides = [*overrides, "cluster.peer_timeout_s=150"]
    args = parser.parse_args([config, *overrides, "--run-dir", str(run_dir), "--time-min", "5", *options])
    assert submit.main(args) == 0
    return dict(json.loads((run_dir / JOB_RECORD).read_text()))


def _wait_done(job_id: str, logs: list[str]) -> list[str]:
    """Wait until the job leaves the queue; returns sacct's states of its components (or tasks)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while query(["squeue", "-h", "-j", job_id]).strip():
            if time.monotonic() > deadline:
                tails = "\n".join(job_log(Path(p))[-3000:] for p in logs if Path(p).exists())
                raise AssertionError(f"job {job_id} not done after {JOB_TIMEOUT_S:.0f}s:\n{tails}")
            time.sleep(1.0)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    return settled_states(job_id)


def _ok_lines(text: str) -> set[tuple[str, int]]:
    return {(m[0], int(m[1])) for m in re.findall(r"\] (\w+) rank (\d+) ok:", text)}


@pytest.mark.slow
def test_hetjob_smoke_runs_each_role_on_its_partition_node(repo_root: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "a b" / 'it\'s "x"'
    overrides = [f"roles.{role}.partition=rollout" for role in ROLES[:4]] + ["roles.trainer.partition=train"]
    start = time.monotonic()
    record = _submit(repo_root, run_dir, overrides)
    assert record["mode"] == "hetjob" and record["world_size"] == 5
    states = _wait_done(str(record["job_id"]), list(record["logs"]))
    log = job_log(Path(str(record["logs"][0])))
    assert states == ["COMPLETED", "COMPLETED"], log
    assert _ok_lines(log) == {(role, rank) for rank, role in enumerate(ROLES)}, log
    assert rank_nodes(run_dir) == {0: "rollout1", 1: "rollout1", 2: "rollout1", 3: "rollout1", 4: "train1"}
    assert step_succeeded(log), log
    print(f"hetjob smoke: submit to done {time.monotonic() - start:.1f}s")


@pytest.mark.slow
def test_submitit_smoke_on_one_partition_over_two_nodes(repo_root: Path, tmp_path: Path) -> None:
    import submitit

    run_dir = tmp_path / "sub mit" / 'it\'s "y"'
    overrides = [f"roles.{role}.partition=all" for role in ROLES] + ["roles.env.num_ranks=2"]
    start = time.monotonic()
    record = _submit(repo_root, run_dir, overrides, "--nodes", "2")
    assert record["mode"] == "submitit" and record["world_size"] == 6
    job_id = str(record["job_id"])
    states = _wait_done(job_id, list(record["logs"]))
    assert states == ["COMPLETED"], job_log(Path(str(record["logs"][1])))
    job: submitit.SlurmJob[int] = submitit.SlurmJob(
        folder=run_dir / "submitit", job_id=job_id, tasks=range(6)
    )
    assert job.results() == [0] * 6
    nodes = rank_nodes(run_dir)
    assert sorted(nodes) == list(range(6)) and sorted(nodes.values()) == ["rollout1"] * 3 + ["train1"] * 3
    rank_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank-*.log"))
    assert _ok_lines(rank_logs) == {
        ("controller", 0),
        ("rollout", 1),
        ("env", 2),
        ("env", 3),
        ("reward", 4),
        ("trainer", 5),
    }
    print(f"submitit smoke: submit to done {time.monotonic() - start:.1f}s")


def test_hetjob_with_more_components_than_nodes_is_refused(repo_root: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "refused"
    overrides = [
        "roles.controller.partition=rollout",
        "roles.rollout.partition=rollout",
        "roles.env.partition=all",
        "roles.reward.partition=all",
        "roles.trainer.partition=train",
    ]
    with pytest.raises(UsageError, match="nodes of its own"):
        _submit(repo_root, run_dir, overrides)
    assert not run_dir.exists()


def test_unknown_partition_is_refused_before_submitting(repo_root: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="'nosuch' not found"):
        _submit(repo_root, tmp_path / "r", [f"roles.{role}.partition=nosuch" for role in ROLES])
