"""The reward service's HPC scale to zero: it exits when idle (releasing its allocation) and the first
client that finds it gone starts it again, exactly once however many clients race.

Without a cluster: the rendered job script (golden file, hostile path), the once-only start under the
lock, idle exit after in-flight work, and a client that restarts a local service through a fake
submission command. On the local SLURM test cluster (marked `slurm`): the service as its own job exits
when idle (COMPLETED) and a client resubmits it with sbatch; the start-up time is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from reward_running import calc_math_traj
from slurm_logs import settled_states

from rollart_hpc.cluster.sbatch import ServiceJob, render_service_job
from rollart_hpc.config.schema import RewardConfig
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.entry import reward_service
from rollart_hpc.reward import ondemand
from rollart_hpc.reward.client import ServiceClient
from rollart_hpc.reward.functions import REWARD_FNS, RewardInput, RewardOutput
from rollart_hpc.reward.service import RewardService
from rollart_hpc.reward.wire import ADDRESS_FILE

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
HOSTILE_DIR = Path('/scratch/it\'s a "reward" dir/svc')


# --- the job script -----------------------------------------------------------------------------------


def test_golden_service_job_with_a_hostile_path() -> None:
    job = ServiceJob(
        Path("/repo/configs/tiny.toml"),
        ("reward.max_workers=4", "run.name=it's"),
        HOSTILE_DIR,
        30,
        600.0,
        partition="rollout",
        python="/venv/bin/python",
        launch=Path("/repo/launch.py"),
    )
    script = render_service_job(job)
    path = GOLDEN / "reward_service.sbatch"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(script)
    assert script == path.read_text(), "differs from tests/golden/reward_service.sbatch (UPDATE_GOLDEN=1)"
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
    exec_line = next(line for line in script.splitlines() if line.startswith("exec "))
    argv = shlex.split(exec_line.replace('"$(hostname)"', "HOST"))
    assert argv[argv.index("--run-dir") + 1] == str(HOSTILE_DIR) and "run.name=it's" in argv
    assert argv[-2:] == ["--idle-exit-s", "600"] and "#SBATCH --partition=rollout" in script


# --- once-only start ----------------------------------------------------------------------------------


def _fake_launch(folder: Path, log: Path, delay_s: float = 0.3) -> None:
    """A 'sbatch' that takes `delay_s`, appends a line to `log` and prints a new job id."""
    code = (
        f"import time, pathlib; time.sleep({delay_s}); p = pathlib.Path({str(log)!r}); "
        "n = len(p.read_text().splitlines()) if p.exists() else 0; "
        "p.open('a').write('submitted\\n'); print(1000 + n)"
    )
    ondemand.write_launch(folder, [sys.executable, "-c", code], folder)


def test_racing_clients_submit_once_and_again_only_when_the_job_is_gone(tmp_path: Path) -> None:
    folder, log = tmp_path / "svc", tmp_path / "submissions"
    folder.mkdir()
    _fake_launch(folder, log)
    gone: set[str] = set()

    def state(job_id: str) -> str | None:
        return None if job_id in gone else "PENDING"

    barrier, results = threading.Barrier(8), []

    def race(i: int) -> None:
        barrier.wait()
        results.append(ondemand.ensure_started(folder, f"client-{i}", state))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results, key=str) == ["1000", *[None] * 7] and len(log.read_text().splitlines()) == 1
    assert ondemand.ensure_started(folder, "late", state) is None  # job 1000 is pending: not again
    with open(folder / ondemand.LOCK_FILE) as held:  # another process deciding: this one only waits
        fcntl.flock(held, fcntl.LOCK_EX)
        gone.add("1000")
        assert ondemand.ensure_started(folder, "blocked", state) is None
    (folder / ADDRESS_FILE).write_text("{}")  # left by a service whose job is gone
    assert ondemand.ensure_started(folder, "next", state) == "1001"
    assert not (folder / ADDRESS_FILE).exists() and len(log.read_text().splitlines()) == 2
    job = json.loads((folder / ondemand.JOB_FILE).read_text())
    assert job["job_id"] == "1001" and job["by"] == "next"
    assert ondemand.record_start(folder, "1001", job["submitted"] + 2.5)["startup_s"] == 2.5  # type: ignore[index]
    assert ondemand.record_start(folder, "999", time.time()) is None  # not the recorded job
    assert len((folder / ondemand.STARTS_FILE).read_text().splitlines()) == 1


# --- idle exit ----------------------------------------------------------------------------------------


def test_idle_service_exits_after_its_in_flight_work_and_removes_its_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow(inp: RewardInput) -> RewardOutput:
        time.sleep(2.5)  # longer than idle_exit_s: an idle exit must wait for it
        return RewardOutput(1.0, True)

    monkeypatch.setitem(REWARD_FNS, "calc_math", slow)
    folder = tmp_path / "svc"
    cfg = RewardConfig(executor="thread", max_workers=1, service_dir=str(folder), service_deadline_s=20.0)

    async def go() -> tuple[Trajectory, float, float]:
        service = RewardService(cfg, folder, idle_exit_s=2.0)
        task = asyncio.create_task(service.run(stats_every_s=0.2))
        client = ServiceClient(cfg, "run-a")
        traj = await client.score(calc_math_traj(1))
        replied = time.monotonic()
        assert not task.done()  # the work in flight kept it up
        await asyncio.wait_for(task, 30)
        client.close()
        return traj, replied, time.monotonic()

    start = time.monotonic()
    traj, replied, exited = asyncio.run(go())
    assert (traj.status, traj.reward) == ("ok", 1.0) and replied - start >= 2.5
    assert (
        1.5 <= exited - replied < 20.0
    )  # idle about idle_exit_s (2 s) after its last work (the reply left before), then gone
    assert not (folder / ADDRESS_FILE).exists()


def test_clients_restart_a_gone_service_once_through_its_launch_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "svc"
    folder.mkdir()
    pid_file = tmp_path / "service.pid"
    serve = shlex.join(
        [
            sys.executable,
            str(REPO / "launch.py"),
            "reward-service",
            "configs/tiny.toml",
            "reward.executor=thread",
        ]
        + ["--run-dir", str(folder), "--idle-exit-s", "2"]
    )
    fake_sbatch = f"SLURM_JOB_ID=4242 {serve} >{shlex.quote(str(tmp_path / 'log'))} 2>&1 & echo $! >{shlex.quote(str(pid_file))}; echo 4242"
    ondemand.write_launch(folder, ["sh", "-c", fake_sbatch], REPO)

    def alive(job_id: str) -> str | None:
        try:
            os.kill(int(pid_file.read_text()), 0)
        except (OSError, ValueError):
            return None
        return "RUNNING"

    monkeypatch.setattr(ondemand, "squeue_state", alive)
    cfg = RewardConfig(service_dir=str(folder), service_timeout_s=0.5, service_deadline_s=60.0)

    async def go() -> tuple[list[Trajectory], list[ServiceClient]]:
        clients = [ServiceClient(cfg, f"run-{i}") for i in range(3)]
        scored = await asyncio.gather(
            *(c.score(calc_math_traj(2 * i + k)) for i, c in enumerate(clients) for k in range(2))
        )
        for c in clients:
            c.close()
        return list(scored), clients

    try:
        scored, clients = asyncio.run(go())
        assert [(t.status, t.reward) for t in scored] == [("ok", 1.0)] * 6
        assert sum(c.counts["starts"] for c in clients) == 1, [c.start_error for c in clients]
        (start,) = [json.loads(line) for line in (folder / ondemand.STARTS_FILE).read_text().splitlines()]
        assert start["job_id"] == "4242" and start["by"].startswith("run-") and start["startup_s"] > 0
        deadline = time.monotonic() + 30
        while alive("4242") and time.monotonic() < deadline:  # idle for 2 s: it exits by itself
            time.sleep(0.1)
        assert alive("4242") is None and not (folder / ADDRESS_FILE).exists()
    finally:
        if pid_file.exists() and alive("4242"):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)


# --- on the local SLURM cluster -----------------------------------------------------------------------


def _squeue_gone(job_id: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30)
        if proc.returncode == 0 and not proc.stdout.strip() or "Invalid job id" in proc.stderr:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no SLURM client on PATH")
def test_slurm_service_exits_when_idle_and_a_client_resubmits_it(tmp_path: Path) -> None:
    folder = tmp_path / "reward 'svc'"
    parser = argparse.ArgumentParser()
    reward_service.add_arguments(parser)
    args = parser.parse_args(
        [str(REPO / "configs/tiny.toml"), "reward.executor=thread", "reward.max_workers=1"]
        + [
            "--run-dir",
            str(folder),
            "--slurm",
            "--partition",
            "rollout",
            "--time-min",
            "5",
            "--idle-exit-s",
            "3",
        ]
    )
    cfg = RewardConfig(service_dir=str(folder), service_timeout_s=1.0, service_deadline_s=120.0)
    jobs: list[str] = []

    async def score(n: int) -> tuple[list[Trajectory], ServiceClient]:
        client = ServiceClient(cfg, "run-a")
        scored = await asyncio.gather(*(client.score(calc_math_traj(i)) for i in range(n)))
        client.close()
        return list(scored), client

    try:
        assert reward_service.main(args) == 0
        jobs.append(json.loads((folder / ondemand.JOB_FILE).read_text())["job_id"])
        first, _ = asyncio.run(score(3))
        assert [(t.status, t.reward) for t in first] == [("ok", 1.0)] * 3
        assert _squeue_gone(jobs[0], 60), f"job {jobs[0]} did not exit when idle"
        assert settled_states(jobs[0]) == ["COMPLETED"] and not (folder / ADDRESS_FILE).exists()
        again, client = asyncio.run(score(2))
        jobs.append(json.loads((folder / ondemand.JOB_FILE).read_text())["job_id"])
        assert [(t.status, t.reward) for t in again] == [("ok", 1.0)] * 2
        assert client.counts["starts"] == 1 and jobs[1] != jobs[0], client.start_error
        starts = [json.loads(line) for line in (folder / ondemand.STARTS_FILE).read_text().splitlines()]
        assert [s["job_id"] for s in starts] == jobs and starts[1]["by"] == "run-a"
        assert all(0 < s["startup_s"] < 120 for s in starts), starts
        print(f"start-up times (submission -> address file): {[s['startup_s'] for s in starts]}")
        assert _squeue_gone(jobs[1], 60) and settled_states(jobs[1]) == ["COMPLETED"]
    finally:
        for job_id in jobs:
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
