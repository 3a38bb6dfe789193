"""Real jobs on the local SLURM test cluster (start it with `slurm/up.sh`, stop it with `slurm/down.sh`).

Covers what the project relies on: both nodes in their partitions, an MPI world of the venv's mpi4py
under `srun --mpi=pmix`, one MPI world across the two components of a heterogeneous job, and
`scontrol requeue`. Every job script, result and log lives in the test's tmp_path; every wait is
bounded, and a job still queued when its test ends is cancelled.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(shutil.which("sinfo") is None, reason="sinfo not on PATH: no SLURM client installed"),
]

REPO = Path(__file__).resolve().parents[1]
MPI_ENV = REPO / "slurm" / "mpi_env.sh"
EXPECTED_PARTITIONS = {"rollout1": {"rollout", "all", "scavenger"}, "train1": {"train", "all", "scavenger"}}

MPI_PROBE = """\
import json, os, sys
from mpi4py import MPI

world = MPI.COMM_WORLD
color = world.rank % 2
group = world.Split(color, world.rank)
result = {
    "rank": world.rank,
    "size": world.size,
    "world_sum": world.allreduce(world.rank + 1),
    "color": color,
    "group_size": group.size,
    "group_sum": group.allreduce(world.rank + 1),
    "node": os.environ.get("SLURMD_NODENAME"),
    "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "library": MPI.Get_library_version().split(",")[0],
    "libmpi": sorted({line.split()[-1] for line in open("/proc/self/maps") if "/libmpi.so" in line}),
}
with open(os.path.join(sys.argv[1], f"rank{world.rank}.json"), "w") as f:
    json.dump(result, f)
group.Free()
"""


def _run(cmd: list[str], timeout: float = 30) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}"
    return proc.stdout


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def _job_output(path: Path) -> str:
    return path.read_text() if path.exists() else "(no job output)"


def _sbatch_wait(script: Path, output: Path, timeout: float) -> None:
    """Submit with `sbatch --wait`; cancel the job and fail if it has not ended within timeout."""
    proc = subprocess.Popen(
        ["sbatch", "--parsable", "--wait", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        job_id = out.split(";")[0].strip()
        if job_id:
            subprocess.run(["scancel", job_id], check=False, timeout=30)
        raise AssertionError(f"job {job_id} not done after {timeout:.0f}s:\n{_job_output(output)}") from None
    assert proc.returncode == 0, f"sbatch --wait exit {proc.returncode}: {err.strip()}\n{_job_output(output)}"


def _write_job(tmp_path: Path, header: list[str], body: list[str]) -> tuple[Path, Path]:
    output = tmp_path / "job.out"
    lines = ["#!/bin/bash", f"#SBATCH --output={output}", "#SBATCH --time=3", *header, "set -euo pipefail"]
    script = tmp_path / "job.sh"
    script.write_text("\n".join([*lines, *body]) + "\n")
    return script, output


def _mpi_results(tmp_path: Path, size: int, output: Path) -> list[dict[str, Any]]:
    files = sorted(tmp_path.glob("rank*.json"))
    assert len(files) == size, f"expected {size} rank results, got {len(files)}:\n{_job_output(output)}"
    return sorted((json.loads(f.read_text()) for f in files), key=lambda r: int(r["rank"]))


def _system_libmpi() -> str:
    """The libmpi that slurm/mpi_env.sh selects for job steps, resolved to its file."""
    out = _run(["bash", "-c", f'source "{MPI_ENV}" && echo "$MPI4PY_LIBMPI"'])
    return str(Path(out.strip()).resolve())


def _mpi_body(tmp_path: Path, srun_args: str) -> list[str]:
    """Run the probe as the launcher's job scripts run a step: srun in the background with the project's
    `srun_watch` beside it, because Slurm 22.05's srun sometimes never exits after a heterogeneous step
    whose tasks all ended (its PMIx abort agent is started once per component and only one is stopped).
    The watcher kills such an srun a few seconds after slurmctld stopped listing the step; the rank
    files, not srun's status, say whether the MPI world worked."""
    probe = tmp_path / "probe.py"
    probe.write_text(MPI_PROBE)
    return [
        f"source {MPI_ENV}",
        f"srun --mpi=pmix {srun_args} {sys.executable} {probe} {tmp_path} &",
        "step=$!",
        f"{sys.executable} -m rollart_hpc.cluster.srun_watch $step --grace-s 5 --poll-s 1 &",
        "watcher=$!",
        'status=0; wait "$step" || status=$?',
        'kill "$watcher" 2>/dev/null || true',
        'echo "srun exited with status $status"',
    ]


@pytest.fixture(autouse=True)
def _controller_up() -> None:
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30, check=False)
    assert "is UP" in ping.stdout, f"slurmctld is not up (start it with slurm/up.sh): {ping.stdout.strip()}"


def test_sinfo_shows_both_nodes_idle_in_their_partitions() -> None:
    def node_rows() -> list[list[str]]:
        return [line.split() for line in _run(["sinfo", "-h", "-N", "-o", "%N %P %T %G"]).splitlines()]

    _wait_for(lambda: all(row[2] == "idle" for row in node_rows()), 30, "both nodes idle")
    rows = node_rows()
    partitions: dict[str, set[str]] = {}
    for node, partition, _state, _gres in rows:
        partitions.setdefault(node, set()).add(partition.rstrip("*"))
    assert partitions == EXPECTED_PARTITIONS
    gres = {node: g for node, _p, _s, g in rows}
    assert gres["train1"].startswith("gpu:2") and gres["rollout1"] == "(null)"


def test_mpi_job_allreduce_and_split_under_srun_pmix(tmp_path: Path) -> None:
    header = ["#SBATCH --partition=rollout --ntasks=2"]
    script, output = _write_job(tmp_path, header, _mpi_body(tmp_path, ""))
    _sbatch_wait(script, output, timeout=120)
    results = _mpi_results(tmp_path, 2, output)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["world_sum"] == 3 for r in results)
    assert [(r["color"], r["group_size"], r["group_sum"]) for r in results] == [(0, 1, 1), (1, 1, 2)]
    assert all(r["node"] == "rollout1" for r in results)
    assert all(str(r["library"]).startswith("Open MPI") for r in results), results
    assert all(r["libmpi"] == [_system_libmpi()] for r in results), results


def test_hetjob_mpi_world_spans_rollout_and_train(tmp_path: Path) -> None:
    header = [
        "#SBATCH --partition=rollout --ntasks=1",
        "#SBATCH hetjob",
        "#SBATCH --partition=train --ntasks=1 --gres=gpu:1",
    ]
    script, output = _write_job(tmp_path, header, _mpi_body(tmp_path, "--het-group=0,1"))
    _sbatch_wait(script, output, timeout=120)
    results = _mpi_results(tmp_path, 2, output)
    assert [r["node"] for r in results] == ["rollout1", "train1"]
    assert all(r["size"] == 2 and r["world_sum"] == 3 for r in results)
    assert results[1]["cuda"] == "0", "the train component must see its one fake GPU"
    assert all(r["libmpi"] == [_system_libmpi()] for r in results), results


def _job_field(job_id: str, field: str) -> str:
    text = _run(["scontrol", "show", "job", job_id])
    for token in text.split():
        key, _, value = token.partition("=")
        if key == field:
            return value
    raise AssertionError(f"{field} not in scontrol show job {job_id}")


def test_requeue_restarts_running_job_with_restart_count(tmp_path: Path) -> None:
    log = tmp_path / "starts.log"
    body = [
        f'echo "restart=${{SLURM_RESTART_COUNT:-0}}" >> {log}',
        'if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then exit 0; fi',
        "sleep 300",
    ]
    header = ["#SBATCH --partition=rollout --ntasks=1 --requeue --open-mode=append"]
    script, output = _write_job(tmp_path, header, body)
    job_id = _run(["sbatch", "--parsable", str(script)]).split(";")[0].strip()
    try:
        _wait_for(lambda: log.exists() and "restart=0" in log.read_text(), 30, "the first start")
        _run(["scontrol", "requeue", job_id])
        _wait_for(lambda: "restart=1" in log.read_text(), 90, "the restart after requeue")
        _wait_for(lambda: _job_field(job_id, "JobState") == "COMPLETED", 30, "the requeued job to complete")
    finally:
        subprocess.run(["scancel", job_id], check=False, timeout=30)
    assert log.read_text().split() == ["restart=0", "restart=1"], _job_output(output)
    assert _job_field(job_id, "Restarts") == "1"
