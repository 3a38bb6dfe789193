"""GPU placement on the local SLURM test cluster, whose node train1 declares 2 (fake) GPUs through gres.

A job whose components request GPUs gets them: each GPU rank reports (in `pids/rank-<r>.pid`, written by
the worker entry after `cluster.placement`) a GPU index of its own within its node, the one the dry run's
plan printed, and ranks without GPUs report none. The fake GPUs are /dev/null, so torch sees no CUDA and
`cluster.require_cuda=false` keeps those ranks on CPU. A job that asks a partition for more GPUs than its
nodes have is refused at submission in one line.
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
from slurm_logs import job_log, step_succeeded

from rollart_hpc.cluster.jobs import JOB_RECORD, sbatch
from rollart_hpc.cluster.plan import make_plan
from rollart_hpc.cluster.sbatch import JobSpec, het_components, render_hetjob
from rollart_hpc.config import load_config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry import submit

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(shutil.which("sinfo") is None, reason="sinfo not on PATH: no SLURM client installed"),
]

JOB_TIMEOUT_S = 240.0
CPU_ROLES = ("controller", "rollout", "env", "reward")
GPU_TRAINERS = [
    "roles.trainer.partition=train",
    "roles.trainer.num_ranks=2",
    "roles.trainer.gpus_per_rank=1",
    "roles.trainer.cpus_per_rank=1",
    "roles.trainer.mem_gb=1",
    "cluster.require_cuda=false",
    "cluster.peer_timeout_s=150",
]


def _args(repo_root: Path, run_dir: Path, overrides: list[str], *options: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    config = str(repo_root / "configs" / "smoke.toml")
    return parser.parse_args([config, *overrides, "--run-dir", str(run_dir), "--time-min", "5", *options])


def _wait_done(job_id: str, log: Path) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while subprocess.run(
            ["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30
        ).stdout.strip():
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not done after {JOB_TIMEOUT_S:.0f}s:\n{_tail(log)}")
            time.sleep(1.0)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)


def _tail(path: Path) -> str:
    return job_log(path)[-3000:] if path.exists() else "(no log)"


def _ranks(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {
        int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in (run_dir / "pids").glob("rank-*.pid")
    }


def _planned(dry_run_out: str) -> dict[int, tuple[str, str]]:
    """rank -> (GPU ids, device) from the placement lines a dry run prints."""
    found = re.findall(
        r"^#   rank (\d+)\s+\w+\s+node \S+\s+local \d+\s+(?:GPU (\S+) -> (cuda:\d+)|(cpu))", dry_run_out, re.M
    )
    return {int(rank): (gpus, device or cpu) for rank, gpus, device, cpu in found}


@pytest.mark.slow
def test_hetjob_gpu_ranks_get_distinct_gpus_of_their_node_as_planned(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "gpu run" / "it's"
    overrides = [f"roles.{role}.partition=rollout" for role in CPU_ROLES] + GPU_TRAINERS
    assert submit.main(_args(repo_root, run_dir, overrides, "--dry-run")) == 0
    dry = capsys.readouterr().out
    assert (
        "#SBATCH --gres=gpu:2\n" in dry
        and "#SBATCH --cpus-per-task=1\n" in dry
        and "#SBATCH --mem=2G\n" in dry
    )
    planned = _planned(dry)
    assert planned == {
        0: ("", "cpu"),
        1: ("", "cpu"),
        2: ("", "cpu"),
        3: ("", "cpu"),
        4: ("0", "cuda:0"),
        5: ("1", "cuda:0"),
    }

    assert submit.main(_args(repo_root, run_dir, overrides)) == 0
    record = json.loads((run_dir / JOB_RECORD).read_text())
    log = Path(record["logs"][0])
    _wait_done(str(record["job_id"]), log)
    assert step_succeeded(_tail(log)), _tail(log)
    ranks = _ranks(run_dir)
    assert sorted(ranks) == list(range(6)), _tail(log)
    trainers = [ranks[4], ranks[5]]
    assert [r["node"] for r in trainers] == ["train1", "train1"]
    assert {tuple(r["gpus"]) for r in trainers} == {("0",), ("1",)}  # distinct GPUs within the node
    for rank, info in ranks.items():
        assert (",".join(info["gpus"]), info["device"]) == planned[rank], (rank, info)
        assert info["torch_device"] == "cpu"  # fake GPUs: no CUDA, cluster.require_cuda=false
    assert all(not ranks[r]["gpus"] and ranks[r]["node"] == "rollout1" for r in range(4))
    assert "[placement] rank 5   trainer    node train1" in job_log(log)


@pytest.mark.slow
def test_submitit_job_on_the_gpu_partition_gives_rollout_and_trainer_their_own_gpu(
    repo_root: Path, tmp_path: Path
) -> None:
    import submitit

    run_dir = tmp_path / "sub gpu"
    # 4 ranks fit train1's 4 CPUs: controller, rollout (GPU), env, trainer (GPU); no reward rank
    overrides = [f"roles.{role}.partition=train" for role in CPU_ROLES] + [
        *GPU_TRAINERS,
        "roles.trainer.num_ranks=1",
        "roles.reward.num_ranks=0",
        "roles.rollout.gpus_per_rank=1",
    ]
    assert submit.main(_args(repo_root, run_dir, overrides)) == 0
    record = json.loads((run_dir / JOB_RECORD).read_text())
    assert record["submitit_parameters"]["gres"] == "gpu:2"
    _wait_done(str(record["job_id"]), Path(record["logs"][1]))
    job: submitit.SlurmJob[int] = submitit.SlurmJob(
        folder=run_dir / "submitit", job_id=str(record["job_id"]), tasks=range(4)
    )
    assert job.results() == [0] * 4
    ranks = _ranks(run_dir)
    assert [(ranks[r]["role"], ranks[r]["gpus"], ranks[r]["device"]) for r in range(4)] == [
        ("controller", [], "cpu"),
        ("rollout", ["0"], "cuda:0"),
        ("env", [], "cpu"),
        ("trainer", ["1"], "cuda:0"),
    ]


def test_more_gpus_than_a_partition_has_fails_at_submission_in_one_line(
    repo_root: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "too many"
    overrides = [f"roles.{role}.partition=rollout" for role in CPU_ROLES] + [
        *GPU_TRAINERS,
        "roles.trainer.num_ranks=3",
    ]
    with pytest.raises(UsageError) as info:
        submit.main(_args(repo_root, run_dir, overrides))
    message = str(info.value)
    assert "roles trainer ask 3 GPUs per node on partition 'train', whose nodes have at most 2" in message
    assert "\n" not in message and not run_dir.exists()


def test_sbatch_itself_refuses_too_many_gpus_in_one_line(repo_root: Path, tmp_path: Path) -> None:
    overrides = [f"roles.{role}.partition=rollout" for role in CPU_ROLES] + [
        *GPU_TRAINERS,
        "roles.trainer.num_ranks=3",
    ]
    config = load_config(repo_root / "configs" / "smoke.toml", overrides)
    script = tmp_path / "job.sbatch"
    spec = JobSpec("too-many", tmp_path / "run", 5, 0, job="smoke")
    script.write_text(render_hetjob(spec, het_components(make_plan(config.roles))))
    with pytest.raises(UsageError) as info:
        sbatch(script)
    assert "sbatch refused" in str(info.value) and "\n" not in str(info.value)
    assert "node configuration is not available" in str(info.value)
