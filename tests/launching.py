"""Runs of `launch.py` in subprocesses (as a user types them) and what a run leaves in its run folder."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from rollart_hpc.cluster.mpiexec import mpi_session, mpiexec_argv
from rollart_hpc.store.trajectories import read_store

REPO = Path(__file__).resolve().parent.parent
TINY = "configs/tiny.toml"


def launch_cmd(*args: object) -> list[str]:
    return [sys.executable, str(REPO / "launch.py"), *map(str, args)]


def launch(*args: object, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`launch.py *args` to its end; with check, it must exit 0 (else its output's tails are shown)."""
    result = subprocess.run(launch_cmd(*args), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def mpiexec_run(
    world_size: int, *program: object, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`python PROGRAM...` on WORLD_SIZE ranks under mpiexec (a session of its own, the ranks' environment
    plus `env`); it must exit 0, else its output's tails are shown."""
    with mpi_session() as base:
        cmd = mpiexec_argv(world_size, sys.executable, *map(str, program))
        result = subprocess.run(
            cmd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def run(run_dir: Path, *overrides: str, config: object = TINY) -> Path:
    """`launch.py run CONFIG --run-dir RUN_DIR OVERRIDES...`, which must succeed; returns RUN_DIR."""
    launch("run", config, "--run-dir", run_dir, *overrides)
    return run_dir


def start(*args: object) -> subprocess.Popen[str]:
    """`launch.py *args` started in the background, its output piped."""
    return subprocess.Popen(
        launch_cmd(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def start_run(run_dir: Path, *args: str, config: object = TINY) -> subprocess.Popen[str]:
    return start("run", config, "--run-dir", run_dir, *args)


def usage_error_line(*args: object) -> str:
    """`launch.py *args` must exit 2 with a single line on stderr, which is returned."""
    result = launch(*args, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def wait_until(predicate: Callable[[], object], timeout_s: float, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(poll_s)


def rank_pid(run_dir: Path, rank: int) -> int:
    return json.loads((run_dir / "pids" / f"rank-{rank}.pid").read_text())["pid"]


def metric_lines(run_dir: Path) -> list[str]:
    """The lines of metrics.jsonl so far (none before the run writes it)."""
    path = run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in metric_lines(run_dir)]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def settled_summary(run_dir: Path) -> dict:
    """summary.json of a finished run, whose accounting balances with nothing left in flight."""
    summary = read_summary(run_dir)
    acc = summary["accounting"]
    assert summary["balanced"] and acc["in_flight"] == acc["buffered"] == acc["in_training"] == 0
    return summary


def stored_records(run_dir: Path) -> list:
    return read_store(run_dir / "trajectories.h5").records
