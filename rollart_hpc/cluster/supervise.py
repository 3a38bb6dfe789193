"""One local MPI world via mpiexec, supervised until nothing of it is left.

`run_world` starts `mpiexec` in its own session with the plan's world size (oversubscription allowed). It
tracks the mpiexec pid and every rank's pid (each rank writes `pids/rank-<r>.pid`). When a rank fails it
aborts the world; the launcher then names the failing rank and role from `failures/`, makes sure every
tracked process is gone, and exits non-zero. Ctrl-C, SIGTERM/SIGHUP or the launch timeout end the whole
world the same way.

The world is over when a rank failed, a rank died without a word (its pid is gone and it neither wrote
`pids/rank-<r>.exit` nor a failure report), or every rank is gone; mpiexec then gets a few seconds to exit
before the launcher ends it (a helper process holding a rank's output pipe would otherwise keep it
waiting forever). Last, each rank's process group is killed, so nothing a rank started outlives the
world (see also `cluster/lifetime.py`). `check_inputs` checks what a local run reads before its run
directory is written. Used by `launch.py run`, `resume` and `evaluate` (`rollart_hpc/entry/launcher.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_hpc.cluster.mpiexec import mpi_session, mpiexec_command
from rollart_hpc.cluster.procs import pid_alive, rank_exit_path
from rollart_hpc.cluster.restarts import WorldOutcome
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout

if TYPE_CHECKING:
    from rollart_hpc.config.schema import Config


def check_inputs(config: Config) -> None:
    """The files a run reads and the network interfaces it names (all ranks run on this node), checked
    before the run directory is written: UsageError, one line."""
    from rollart_hpc.cluster.env import interface_address

    net = config.cluster.net
    for key in ("nccl_socket_ifname", "gloo_socket_ifname"):
        if getattr(net, key):
            interface_address(getattr(net, key), f"cluster.net.{key}")
    if config.model.source == "path":
        from rollart_hpc.models.validate import check_model_dir

        check_model_dir(config.model.path)
    if config.run.job in ("rl", "eval"):
        from rollart_hpc.tasks.checks import check_own_code

        for line in check_own_code(config.envs, config.reward, config.run.python_path):
            print(line, flush=True)
    if config.run.job == "rl" and "household" in config.envs.families:
        from rollart_hpc.tasks.families.household_data import load_manifest

        try:
            load_manifest()
        except FileNotFoundError as exc:
            raise UsageError(str(exc)) from None


def run_world(run_dir: Path, world_size: int, timeout_s: float = 0.0) -> int:
    """Start mpiexec, wait for it, then report failures and reap every tracked process; the exit code."""
    return run_world_outcome(run_dir, world_size, timeout_s).code


def run_world_outcome(run_dir: Path, world_size: int, timeout_s: float = 0.0) -> WorldOutcome:
    """`run_world`, returning the outcome (for `--max-restarts`)."""
    RunLayout(run_dir).pids.mkdir(parents=True, exist_ok=True)
    for stale in (
        *RunLayout(run_dir).pids.glob("rank-*.pid"),
        *RunLayout(run_dir).pids.glob("rank-*.exit"),
    ):
        stale.unlink()
    if RunLayout(run_dir).failures.exists():  # an earlier attempt's reports (resume) are not this world's
        shutil.rmtree(RunLayout(run_dir).failures)
    from rollart_hpc.config import read_resolved

    net_env = read_resolved(run_dir).cluster.net.environment()
    watch = WorldWatch(run_dir, world_size)
    with mpi_session(net_env) as env:  # its folder goes once every tracked process is gone
        proc = subprocess.Popen(mpiexec_command(world_size, run_dir), env=env, start_new_session=True)
        reason = _wait_world(proc, watch, timeout_s)
        if proc.poll() is None:
            stop_session(proc)
        leftovers = reap_ranks(run_dir)
    code = report(run_dir, proc.returncode, reason, leftovers, watch)
    return WorldOutcome(code, failure_cause(run_dir, watch) if code else None, reason is not None)


def _wait_world(proc: subprocess.Popen[bytes], watch: WorldWatch, timeout_s: float) -> str | None:
    """Wait until mpiexec exits or the world is over; why the launcher must stop it (None: no need)."""
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    reason = None
    # mpiexec runs in its own session, so a SIGTERM/SIGHUP that kills only the launcher would orphan the
    # world: turn them into the same orderly stop as Ctrl-C. SIGINT is set too: a launcher started in the
    # background of a non-interactive shell inherits it ignored, and `kill -INT` must still stop the world.
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while proc.poll() is None:
            if watch.poll():
                break  # the world is over but mpiexec lingers (a pipe held open): end it below
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
    return reason


# Seconds mpiexec gets to exit by itself once the world is over (a rank gone without a word, a rank failed,
# or every rank finished) before the launcher ends it.
WORLD_END_GRACE_S = 3.0
# Ranks seen gone within this many seconds of the first silent death are named with it (one cause).
SAME_MOMENT_S = 0.1


class WorldWatch:
    """Watches the ranks' pid files: which rank processes ended, in order, and whether each finished."""

    def __init__(self, run_dir: Path, world_size: int) -> None:
        self.run_dir, self.world_size = run_dir, world_size
        self.vanished: list[int] = []  # ranks whose process ended, in the order the launcher saw it
        self.vanished_at: dict[int, float] = {}  # rank -> wall time the launcher saw it gone
        self.over_since: float | None = None
        self._pids: dict[int, int] = {}  # rank -> pid, read once from its pid file (written once a world)

    def finished(self, rank: int) -> bool:
        return rank_exit_path(self.run_dir, rank).exists()

    def silent_deaths(self) -> list[int]:
        """Ranks that ended without finishing their main and without writing a failure report."""
        failed = failure_ranks(self.run_dir)
        return [r for r in self.vanished if not self.finished(r) and r not in failed]

    def over(self) -> bool:
        everyone_gone = len(self.vanished) == self.world_size
        return everyone_gone or bool(self.silent_deaths()) or bool(failure_ranks(self.run_dir))

    def poll(self) -> bool:
        """Update; True once the world has been over for WORLD_END_GRACE_S (mpiexec should be gone)."""
        self._note_vanished()
        for rank in self.vanished:
            self.vanished_at.setdefault(rank, time.time())
        if self.over_since is None and self.over():
            self.over_since = time.monotonic()
        return self.over_since is not None and time.monotonic() - self.over_since > WORLD_END_GRACE_S

    def all_finished(self) -> bool:
        return all(self.finished(r) for r in range(self.world_size))

    def _note_vanished(self) -> None:
        if len(self._pids) < self.world_size:
            for path in RunLayout(self.run_dir).pids.glob("rank-*.pid"):
                rank = int(path.stem.split("-")[1])
                if rank not in self._pids:
                    self._pids[rank] = int(json.loads(path.read_text())["pid"])
        for rank, pid in self._pids.items():
            if rank not in self.vanished and not pid_alive(pid):
                self.vanished.append(rank)


def failure_ranks(run_dir: Path) -> set[int]:
    return {int(p.stem.split("-")[1]) for p in RunLayout(run_dir).failures.glob("rank-*.json")}


class _TerminatedError(Exception):
    """SIGTERM or SIGHUP reached the launcher while it waited for mpiexec."""


def _raise_terminated(signum: int, _frame: object) -> None:
    raise _TerminatedError(signal.Signals(signum).name)


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
    for path in RunLayout(run_dir).pids.glob("rank-*.pid"):
        pids[int(path.stem.split("-")[1])] = int(json.loads(path.read_text())["pid"])
    return pids


def rank_roles(run_dir: Path) -> dict[int, str]:
    roles = {}
    for path in RunLayout(run_dir).pids.glob("rank-*.pid"):
        roles[int(path.stem.split("-")[1])] = str(json.loads(path.read_text())["role"])
    return roles


def reap_ranks(run_dir: Path, grace_s: float = 5.0) -> list[int]:
    """Make sure no process of a rank outlives the world: SIGKILL, by pid, any rank still alive, then each
    rank's own process group (helpers a rank started, e.g. dist_checkpointing's Manager) if it has members.
    Returns the ranks whose own process outlived the world (helpers still exiting after their rank ended
    are ended without a word)."""
    pids = rank_pids(run_dir)
    deadline = time.monotonic() + grace_s
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftovers = {rank for rank, pid in pids.items() if pid_alive(pid)}
    for rank in leftovers:
        os.kill(pids[rank], signal.SIGKILL)
    for pgid in rank_groups(run_dir).values():
        kill_group(pgid)
    return sorted(leftovers)


def rank_groups(run_dir: Path) -> dict[int, int]:
    """Each rank's process group, where the rank leads its own (mpiexec starts each rank in a new group)."""
    groups = {}
    for path in RunLayout(run_dir).pids.glob("rank-*.pid"):
        info = json.loads(path.read_text())
        if info.get("pgid") == info["pid"]:
            groups[int(path.stem.split("-")[1])] = int(info["pgid"])
    return groups


def kill_group(pgid: int) -> bool:
    """SIGKILL a process group; True if it still had members."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def failure_cause(run_dir: Path, watch: WorldWatch) -> str | None:
    """The first named failure by time: a rank's reported error or a rank that died without a word (a
    peer's report of that death comes after it)."""
    roles = rank_roles(run_dir)
    events = [
        (f["time"], f"rank {f['rank']} ({f['role']}) failed: {f['message']}")
        for f in (json.loads(p.read_text()) for p in RunLayout(run_dir).failures.glob("rank-*.json"))
    ]
    events += [
        (watch.vanished_at[r], f"rank {r} ({roles.get(r, '?')}) died without reporting an error")
        for r in watch.silent_deaths()
    ]
    return min(events)[1] if events else None


def report(
    run_dir: Path, returncode: int | None, reason: str | None, leftovers: list[int], watch: WorldWatch
) -> int:
    failures = (
        sorted(
            (json.loads(p.read_text()) for p in RunLayout(run_dir).failures.glob("rank-*.json")),
            key=lambda f: f["time"],
        )
        if RunLayout(run_dir).failures.exists()
        else []
    )
    if failures:
        first = failures[0]
        print(f"error: rank {first['rank']} ({first['role']}) failed: {first['message']}", file=sys.stderr)
        later = ", ".join(f"rank {f['rank']} ({f['role']})" for f in failures[1:])
        if later:
            print(f"error: then also failed: {later} (see {run_dir / 'failures'})", file=sys.stderr)
    silent = watch.silent_deaths()
    if not failures and silent and reason is None:
        # No rank reported an error: the first process to vanish died without a word (SIGKILL, OOM, crash).
        # mpiexec may end a peer within the same poll: every rank seen gone at that moment is named.
        roles = rank_roles(run_dir)
        first = watch.vanished_at.get(silent[0], 0.0)
        together = [r for r in silent if watch.vanished_at.get(r, 0.0) - first <= SAME_MOMENT_S]
        for rank in together:
            print(
                f"error: rank {rank} ({roles.get(rank, '?')}) died without reporting an error (killed or crashed)",
                file=sys.stderr,
            )
    if leftovers:
        print(f"warning: killed leftover processes of ranks {leftovers}", file=sys.stderr)
    if reason is not None:
        print(f"error: run stopped: {reason}", file=sys.stderr)
        if "Ctrl-C" in reason:
            return 130
        return 128 + signal.SIGTERM if "SIGTERM" in reason else 1
    if not failures and not silent and watch.all_finished():
        return 0  # every rank finished its main; mpiexec's own exit code does not matter then
    if returncode != 0 and not failures and not silent:
        print(f"error: mpiexec exited with code {returncode} and no rank reported a failure", file=sys.stderr)
    return 0 if returncode == 0 and not failures and not silent else 1
