"""Chaos trials: fault injection against the automatic recovery of local runs (`launch.py chaos`, whose
module `rollart_hpc.entry.chaos` documents the faults and what a trial checks).

Each trial runs the config (`launch.py run ... --max-restarts M`, in `WORK_DIR/trial-<i>/`) and injects
one fault into one rank, both drawn from the seed (each round of len(FAULTS) trials has every kind once):

- `kill`: SIGKILL, any role including the controller;
- `stop`: SIGSTOP for longer than `cluster.peer_timeout_s`: the peers' liveness check ends the world; a
  rank still stopped after the timeout and a margin is SIGKILLed, as a node watchdog would;
- `checkpoint`: a file of the newest complete checkpoint truncated or deleted, then the rank SIGKILLed:
  the restart must discard that checkpoint and fall back to an older one or to the start;
- `disk`: a disk that refuses writes, on a rank that writes run files (controller or trainer): its
  RLIMIT_FSIZE drops to half the size of the largest file it writes (`limit_file_size`), so its next
  write there fails (EFBIG; Python ignores SIGXFSZ); the restarted rank is a fresh process, unlimited;
- `engine`: a rollout rank's engine dies and the rank rebuilds it in place (`rollout/resilient.py`), no
  restart: the built-in engine (inside the rank) fails its next step on `ENGINE_FAULT_SIGNAL`; a vLLM
  engine core (a child process of the rank) is SIGKILLed.

The fault comes after a drawn number of optimizer steps plus a drawn fraction of a step. The trial then
lets the restarts (or the rebuild) act and checks the finished run from `summary.json` and the HDF5
store: no trajectory lost (dispatched = trained + dropped + failed, and the store holds every trained
one), none trained twice, at least one restart (`engine`: none, and at least one engine rebuild of the
target rank), the steps trained again after the restart and the seconds from the fault to the first new
step after it (after the restart, where there is one).

Dataflow: this process starts the launcher (its own session) and only reads the run directory (pid
files, metrics.jsonl, restarts.jsonl, checkpoints) while it waits; it signals ranks by the pid each rank
wrote. A trial that outlives its timeout gets SIGTERM (the launcher ends its world), then SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollart_hpc.cluster.procs import children, pid_alive
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout

FAULTS = ("kill", "stop", "checkpoint", "disk", "engine")
# The roles a fault may hit (every role where absent): `disk` hits ranks that write run files, `engine`
# the ranks that run an engine.
TARGET_ROLES = {"disk": ("controller", "trainer"), "engine": ("rollout",)}
# Applied before the user's overrides (which win): a checkpoint every step, two kept (so a damaged newest
# one has an older one to fall back to), steps enough for a fault mid-run, a peer timeout short enough
# for a `stop` trial to end in reasonable time.
CHAOS_DEFAULTS = (
    "controller.checkpoint_every_steps=1",
    "controller.keep_checkpoints=2",
    "controller.num_steps=8",
    "cluster.peer_timeout_s=40",
)
POLL_S = 0.1


@dataclass(frozen=True)
class Setup:
    """What every trial shares."""

    config: Path
    overrides: tuple[str, ...]
    roles: dict[int, str]  # rank -> role
    engine: str  # rollout.engine: "builtin" runs inside the rank, "vllm" in a child process
    num_steps: int
    peer_timeout_s: float
    max_restarts: int
    timeout_s: float


@dataclass(frozen=True)
class FaultPlan:
    fault: str
    rank: int
    role: str
    after_steps: int  # optimizer steps finished before the fault
    step_fraction: float  # then this fraction of the last step's duration


def run_trials(setup: Setup, work: Path, trials: int, seed: int) -> dict[str, Any]:
    """Run `trials` trials in `work/trial-<i>/`, the faults drawn from `seed`; the table of trials."""
    rows = []
    for index, plan in enumerate(plan_trials(random.Random(seed), setup, trials)):
        print(
            f"trial {index}: {plan.fault} rank {plan.rank} ({plan.role}) after {plan.after_steps} steps",
            flush=True,
        )
        rows.append(run_trial(work / f"trial-{index}", plan, setup, random.Random(f"{seed}-{index}")))
    return table(rows)


def make_setup(
    config_path: str | Path, overrides: Sequence[str], max_restarts: int, timeout_s: float
) -> Setup:
    """What every trial of `config_path` with `overrides` (after `CHAOS_DEFAULTS`) shares; UsageError
    when the run cannot recover from the faults (too few checkpoints, steps or engine rebuilds)."""
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.config import load_config

    if max_restarts < 1:
        raise UsageError(f"--max-restarts must be >= 1, got {max_restarts}")
    overrides = (*CHAOS_DEFAULTS, *overrides)
    config = load_config(config_path, overrides)
    c = config.controller
    checkpoints_ok = c.keep_checkpoints >= 2 and c.checkpoint_every_steps >= 1 and c.num_steps >= 3
    if config.run.job != "rl" or not checkpoints_ok or config.rollout.max_engine_rebuilds < 1:
        raise UsageError(
            "chaos needs an RL run with controller.keep_checkpoints >= 2, "
            "controller.checkpoint_every_steps >= 1, controller.num_steps >= 3 "
            "and rollout.max_engine_rebuilds >= 1"
        )
    plan = make_plan(config.roles)
    roles = {rank: plan.role_of(rank).role for rank in range(plan.world_size)}
    return Setup(
        Path(config_path).resolve(), overrides, roles, config.rollout.engine, c.num_steps,
        config.cluster.peer_timeout_s, max_restarts, timeout_s,
    )  # fmt: skip


def plan_trials(rng: random.Random, setup: Setup, trials: int) -> list[FaultPlan]:
    """One fault per trial; every kind once per round of len(FAULTS) trials, in a drawn order."""
    plans: list[FaultPlan] = []
    kinds: list[str] = []
    for _ in range(trials):
        kinds = kinds or rng.sample(FAULTS, len(FAULTS))
        plans.append(plan_fault(rng, setup, kinds.pop()))
    return plans


def plan_fault(rng: random.Random, setup: Setup, fault: str) -> FaultPlan:
    roles = TARGET_ROLES.get(fault)
    rank = rng.choice(sorted(r for r, role in setup.roles.items() if roles is None or role in roles))
    after = rng.randint(1, setup.num_steps - 2)
    return FaultPlan(fault, rank, setup.roles[rank], after, round(rng.random(), 3))


# ---------------------------------------------------------------- reading the run directory while it runs


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl with a version (a half-written last line is skipped)."""
    from rollart_hpc.metrics.run_metrics import read_rows

    rows = []
    for row in read_rows(RunLayout(run_dir).metrics):
        try:
            int(row["version"])
        except (ValueError, KeyError, TypeError):
            continue
        rows.append(row)
    return rows


def metric_versions(run_dir: Path) -> list[int]:
    return [int(row["version"]) for row in metric_rows(run_dir)]


def last_step_s(rows: list[dict[str, Any]]) -> float:
    """The last step's duration from the rows' run clock (`wall_s`), within [POLL_S, 10] s; 1 s unknown."""
    try:
        seconds = float(rows[-1]["wall_s"]) - (float(rows[-2]["wall_s"]) if len(rows) >= 2 else 0.0)
    except (IndexError, KeyError, TypeError, ValueError):
        seconds = 1.0
    return min(max(seconds, POLL_S), 10.0)


def metrics_inode(run_dir: Path) -> int | None:
    try:
        return RunLayout(run_dir).metrics.stat().st_ino
    except FileNotFoundError:
        return None


def rank_pid(run_dir: Path, rank: int) -> int | None:
    try:
        return int(json.loads(RunLayout(run_dir).pid_file(rank).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def restart_rows(run_dir: Path) -> list[dict[str, Any]]:
    from rollart_hpc.contracts.rundir import read_restarts

    try:
        return read_restarts(run_dir)
    except ValueError:
        return []


# ---------------------------------------------------------------- one trial


@dataclass
class Injection:
    at_s: float  # seconds after the trial started
    at: float  # time.monotonic() of the fault
    pid: int
    detail: str


def run_trial(run_dir: Path, plan: FaultPlan, setup: Setup, rng: random.Random) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "rollart_hpc.entry.cli", "run", str(setup.config), *setup.overrides,
        "--run-dir", str(run_dir), "--max-restarts", str(setup.max_restarts),
    ]  # fmt: skip
    started = time.monotonic()
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            injection = wait_and_inject(proc, run_dir, plan, setup.engine, started, rng)
            if injection is not None and plan.fault == "stop":
                end_stopped(injection, setup.peer_timeout_s)
            follow = follow_rebuild if plan.fault == "engine" else follow_recovery
            recovery = follow(proc, run_dir, injection, started + setup.timeout_s)
            proc.wait(timeout=max(1.0, started + setup.timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            recovery = {}
        finally:
            stop_launcher(proc)
    row = assess(run_dir, plan, proc.returncode, injection, recovery)
    return {**asdict(plan), **row, "wall_s": round(time.monotonic() - started, 1)}


def wait_and_inject(
    proc: subprocess.Popen[bytes], run_dir: Path, plan: FaultPlan, engine: str, started: float,
    rng: random.Random,
) -> Injection | None:  # fmt: skip
    """Wait for `after_steps` steps (and, for a checkpoint or disk fault, a complete checkpoint), then a
    fraction of the last step's duration (or until the next step ends); inject. None when the run ended
    first."""
    from rollart_hpc.controller.checkpoint import latest

    needs_checkpoint = plan.fault in ("checkpoint", "disk")
    while proc.poll() is None:
        rows = metric_rows(run_dir)
        if len(rows) >= plan.after_steps and (not needs_checkpoint or latest(run_dir) is not None):
            # A fraction of the last step's duration, cut short when the next step ends first (steps
            # vary: the first ones load and checkpoint, later ones may take a fraction of that).
            until = time.monotonic() + plan.step_fraction * last_step_s(rows)
            while time.monotonic() < until and len(metric_rows(run_dir)) == len(rows):
                time.sleep(POLL_S / 2)
            pid = rank_pid(run_dir, plan.rank)
            if pid is not None and proc.poll() is None and RunLayout(run_dir).summary.exists() is False:
                detail = inject(plan, pid, run_dir, engine, rng)
                return Injection(round(time.monotonic() - started, 2), time.monotonic(), pid, detail)
        time.sleep(POLL_S)
    return None


def inject(plan: FaultPlan, pid: int, run_dir: Path, engine: str, rng: random.Random) -> str:
    if plan.fault == "stop":
        os.kill(pid, signal.SIGSTOP)
        return "SIGSTOP"
    if plan.fault == "disk":
        return limit_file_size(pid, plan.role, run_dir)
    if plan.fault == "engine":
        return fail_engine(pid, engine)
    detail = "SIGKILL"
    if plan.fault == "checkpoint":
        detail = damage_checkpoint(run_dir, rng) + "; SIGKILL"
    os.kill(pid, signal.SIGKILL)
    return detail


def damage_checkpoint(run_dir: Path, rng: random.Random) -> str:
    """Truncate to half or delete one drawn file of the newest complete checkpoint (not its marker)."""
    from rollart_hpc.controller.checkpoint import COMPLETE, latest

    path = latest(run_dir)
    assert path is not None
    files = sorted(p for p in path.rglob("*") if p.is_file() and p != path / COMPLETE)
    target = rng.choice(files)
    name = f"{path.name}/{target.relative_to(path)}"
    if rng.random() < 0.5:
        size = target.stat().st_size
        with target.open("r+b") as fh:
            fh.truncate(size // 2)
        return f"truncated {name} {size}->{size // 2} bytes"
    target.unlink()
    return f"deleted {name}"


def limit_file_size(pid: int, role: str, run_dir: Path) -> str:
    """RLIMIT_FSIZE of the rank and its children down to half the size of the largest file it writes:
    the store (controller; its chunks are allocated at once, so later appends write inside the file
    rather than at its end) or its part of the newest checkpoint (trainer; its writer processes are forked
    per save and inherit the limit)."""
    from rollart_hpc.controller.checkpoint import latest

    if role == "controller":
        target = RunLayout(run_dir).trajectories
    else:
        newest = latest(run_dir)
        assert newest is not None
        target = max(
            (p for p in (newest / "trainer").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
        )
    limit = target.stat().st_size // 2
    for process in (pid, *children(pid)):
        try:
            resource.prlimit(process, resource.RLIMIT_FSIZE, (limit, limit))
        except ProcessLookupError:
            continue
    return f"RLIMIT_FSIZE {limit} bytes (half of {target.relative_to(run_dir)})"


def fail_engine(pid: int, engine: str) -> str:
    """A vLLM engine's own process (a child of the rank) is SIGKILLed; a built-in engine, which runs
    inside the rank, fails its next step on `ENGINE_FAULT_SIGNAL`."""
    from rollart_hpc.rollout.resilient import ENGINE_FAULT_SIGNAL

    engine_processes = children(pid) if engine == "vllm" else []
    if engine_processes:
        for child in engine_processes:
            os.kill(child, signal.SIGKILL)
        return f"SIGKILL engine process {', '.join(map(str, engine_processes))}"
    os.kill(pid, ENGINE_FAULT_SIGNAL)
    return f"SIGRTMIN+{ENGINE_FAULT_SIGNAL - signal.SIGRTMIN}: the engine's next step fails"


def end_stopped(injection: Injection, peer_timeout_s: float) -> None:
    """A stopped rank is ended by the world (its peers time out, the launcher kills it); one still there
    after the peer timeout and a margin is SIGKILLed here."""
    deadline = injection.at + peer_timeout_s + 60.0
    while pid_alive(injection.pid) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if pid_alive(injection.pid):
        os.kill(injection.pid, signal.SIGKILL)
        injection.detail += f"; still stopped after {peer_timeout_s + 60:g}s: SIGKILL"
    else:
        injection.detail += f"; ended by the world after {time.monotonic() - injection.at:.1f}s"


def follow_recovery(
    proc: subprocess.Popen[bytes], run_dir: Path, injection: Injection | None, deadline: float
) -> dict[str, Any]:
    """Until the run ends: the newest version trained before the first restart, the checkpoint step the
    restart resumed from, and the seconds from the fault to the first step trained after it."""
    if injection is None:
        return {}
    before = 0
    while proc.poll() is None and not restart_rows(run_dir) and time.monotonic() < deadline:
        before = max([before, *metric_versions(run_dir)])
        time.sleep(POLL_S)
    before = max([before, *metric_versions(run_dir)])
    rows = restart_rows(run_dir)
    if not rows:
        return {"steps_before": before}
    resumed, inode = int(rows[0]["step"]), metrics_inode(run_dir)
    out: dict[str, Any] = {"steps_before": before, "resumed_from": resumed}
    # The new controller rewrites metrics.jsonl back to the checkpoint (a new file), then appends.
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics_inode(run_dir) != inode and any(v > resumed for v in metric_versions(run_dir)):
            out["recovery_s"] = round(time.monotonic() - injection.at, 2)
            break
        time.sleep(POLL_S)
    return out


def follow_rebuild(
    proc: subprocess.Popen[bytes], run_dir: Path, injection: Injection | None, deadline: float
) -> dict[str, Any]:
    """An engine fault (no restart expected): the seconds from the fault to the first step trained after
    it."""
    if injection is None:
        return {}
    before = max(metric_versions(run_dir), default=0)
    out: dict[str, Any] = {"steps_before": before}
    while proc.poll() is None and time.monotonic() < deadline and not restart_rows(run_dir):
        if any(v > before for v in metric_versions(run_dir)):
            out["recovery_s"] = round(time.monotonic() - injection.at, 2)
            break
        time.sleep(POLL_S)
    return out


def stop_launcher(proc: subprocess.Popen[bytes]) -> None:
    """A launcher still running (trial timeout): SIGTERM (it ends its world), then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- checks after a trial


def assess(
    run_dir: Path, plan: FaultPlan, code: int | None, injection: Injection | None, recovery: dict[str, Any]
) -> dict[str, Any]:
    lost, duplicated, counts = audit(run_dir)
    restarts = restart_rows(run_dir)
    finished = code == 0 and RunLayout(run_dir).summary.exists()
    resumed = recovery.get("resumed_from")
    redone = max(0, recovery["steps_before"] - resumed) if resumed is not None else None
    rebuilds = rank_rebuilds(run_dir, plan)
    if plan.fault == "engine":  # rebuilt in place: no restart, nothing trained again
        recovered = not restarts and (rebuilds or 0) >= 1
        redone = 0 if recovered else redone
    else:
        recovered = bool(restarts)
    return {
        "injected": injection is not None,
        "detail": injection.detail if injection else "run ended before the fault",
        "injected_at_s": injection.at_s if injection else None,
        "exit_code": code,
        "finished": finished,
        "restarts": len(restarts),
        "resumed_from_step": resumed,
        "survived": bool(finished and injection and recovered and lost == 0 and duplicated == 0),
        "lost": lost,
        "duplicated": duplicated,
        "steps_redone": redone,
        "recovery_s": recovery.get("recovery_s"),
        "rebuilds": rebuilds,
        "accounting": counts,
    }


def rank_rebuilds(run_dir: Path, plan: FaultPlan) -> int | None:
    """Engine (rollout) or worker pool (reward) rebuilds of the target rank in the finished run's
    summary.json (the last world's); None for other roles or without a summary."""
    try:
        counts = json.loads(RunLayout(run_dir).summary.read_text())["failures_and_rebuilds"]
        return int(counts[f"{plan.role} rank {plan.rank}"]["rebuilds"])
    except (OSError, ValueError, KeyError):
        return None


def audit(run_dir: Path) -> tuple[int | None, int | None, dict[str, int]]:
    """(lost, duplicated, counts) from summary.json and the store; None where they cannot be read.
    Lost: dispatched minus trained, dropped and failed, plus trained ones missing from the store.
    Duplicated: trained store rows beyond the first of each episode id."""
    from collections import Counter

    from rollart_hpc.store.trajectories import read_store

    try:
        acc = json.loads(RunLayout(run_dir).summary.read_text())["accounting"]
        records = read_store(RunLayout(run_dir).trajectories).records
    except (OSError, ValueError, KeyError):
        return None, None, {}
    counts: dict[str, int] = {
        "dispatched": int(acc["dispatched"]),
        "trained": int(acc["trained"]),
        "dropped": sum(acc["dropped"].values()),
        "failed": sum(acc["failed"].values()),
        "store_trained": sum(r.final_status == "trained" for r in records),
    }
    done = counts["trained"] + counts["dropped"] + counts["failed"]
    lost = abs(counts["dispatched"] - done) + max(0, counts["trained"] - counts["store_trained"])
    ids = Counter(r.episode_id for r in records if r.final_status == "trained")
    duplicated = sum(n - 1 for n in ids.values()) + max(0, counts["store_trained"] - counts["trained"])
    return lost, duplicated, counts


def table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "trials": len(rows),
        "survived": sum(bool(r["survived"]) for r in rows),
        "lost": sum(r["lost"] or 0 for r in rows),
        "duplicated": sum(r["duplicated"] or 0 for r in rows),
        "unreadable": sum(r["lost"] is None for r in rows),
        "rows": rows,
    }


COLUMNS = (
    ("trial", 5), ("fault", 10), ("rank", 4), ("role", 10), ("injected_at_s", 13), ("survived", 8),
    ("lost", 4), ("duplicated", 10), ("steps_redone", 12), ("recovery_s", 10), ("restarts", 8),
    ("rebuilds", 8), ("wall_s", 7),
)  # fmt: skip


def format_table(result: dict[str, Any]) -> str:
    lines = ["  ".join(name.rjust(width) for name, width in COLUMNS)]
    for index, row in enumerate(result["rows"]):
        values = {**row, "trial": index}
        lines.append("  ".join(str(values[name]).rjust(width) for name, width in COLUMNS))
        lines.append(f"        {row['detail']}")
    lines.append(
        f"trials {result['trials']}  survived {result['survived']}  lost {result['lost']}  "
        f"duplicated {result['duplicated']}"
    )
    return "\n".join(lines)
