"""`launch.py bench controller --json OUT`: the controller's bookkeeping alone, on one core, no model.

A real `ControllerCore` with a real `EventTimeTracker` and `TaskSampler` is driven the way the controller
rank drives it (dispatch -> results in shuffled order -> next batch -> publish -> rollout version), with
synthetic `Trajectory` records instead of env workers. Only the calls into the core are timed; building
the synthetic trajectories is not. Two parts:

- throughput, per task count (`--tasks`, comma-separated): async mode, staleness 1; results of half of
  the episodes in flight arrive per round, in random order; runs `--steps` steps or until `--budget-s`
  of bookkeeping time is spent. A row's `trajectories_per_s` = trained trajectories / bookkeeping
  seconds. The goal (>= 20,000/s) is stated at 10,000 and at 100,000 tasks, so the headline
  `trajectories_per_s` is the row at 10,000 tasks, `trajectories_per_s_by_num_tasks` holds every row, and
  `meets_goal` needs both goal rows to reach it (a best row over easier task counts would hide a draw
  that slows with the task count); a goal row left out of `--tasks` gives a null headline and no goal.
- in flight (`--in-flight`, default 10,000): fill to that many tickets in flight, then drain them. Time
  per dispatch and per result, by how many are in flight (10 bins), and `next_batch` while it must wait;
  memory in a second identical pass under tracemalloc (peak, bytes per ticket in flight) and the process
  RSS after each of `--cycles` fill/drain/train cycles (bounded: no growth from cycle to cycle).

Synthetic trajectories share one token payload (their lists are the same objects), so memory numbers
measure bookkeeping, not trajectory payloads. A cProfile of one throughput pass names the hot spots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.records import EpisodeTicket, Trajectory
from rollart_hpc.controller.core import ControllerCore, CoreSettings

GOAL_TRAJECTORIES_PER_S = 20_000.0
GOAL_NUM_TASKS = (10_000, 100_000)  # the goal must hold at each; the headline is the first
NUM_BINS = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", required=True, help="write the results here (JSON)")
    parser.add_argument("--tasks", default="100,1000,10000,100000", help="task counts of the throughput part")
    parser.add_argument("--batch", type=int, default=256, help="trajectories per step (throughput part)")
    parser.add_argument("--steps", type=int, default=40, help="most steps per throughput measurement")
    parser.add_argument("--budget-s", type=float, default=10.0, help="bookkeeping seconds per task count")
    parser.add_argument("--in-flight", type=int, default=10_000, help="tickets in flight (in-flight part)")
    parser.add_argument("--in-flight-tasks", type=int, default=100, help="tasks of the in-flight part")
    parser.add_argument("--cycles", type=int, default=3, help="fill/drain/train cycles for the RSS check")
    parser.add_argument("--seed", type=int, default=0, help="seed of rewards, arrival order and sampler")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile of the hot spots")


# ---- the driven system ----------------------------------------------------------------------------
def make_core(num_tasks: int, cap: int, batch: int, steps: int, seed: int) -> ControllerCore:
    """An async core (staleness 1) over `num_tasks` synthetic task ids, built as the controller rank
    builds its own (`ControllerCore.build`)."""
    task_ids = [f"task{i:06d}" for i in range(num_tasks)]
    settings = CoreSettings(
        batch_size=batch, max_staleness=1, mode="async", num_steps=steps, max_in_flight_per_task=cap
    )
    return ControllerCore.build(settings, task_ids, seed)


class Results:
    """Synthetic finished episodes: one shared token payload, a per-task success probability."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.template = Trajectory(task_id="", family="synthetic", tags=("cpu",), episode_id="")
        self.template.append(list(range(64)), False, [], [])
        for _turn in range(3):
            self.template.append(list(range(16)), True, [-0.5] * 16, [0] * 16)
            self.template.append(list(range(8)), False, [], [])
        self.template.finish_cause = "done"
        self.p_success: dict[str, float] = {}

    def make(self, ticket: EpisodeTicket) -> Trajectory:
        p = self.p_success.setdefault(ticket.task_id, self.rng.random())
        won = self.rng.random() < p
        return dataclasses.replace(
            self.template,
            task_id=ticket.task_id,
            episode_id=ticket.episode_id,
            reward=1.0 if won else 0.0,
            success=won,
            dispatch={"version": ticket.version},
        )


class OpTimer:
    """Seconds and calls per operation name; `call` times one call into the core."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        self.calls[name] = self.calls.get(name, 0) + 1
        return out

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def per_op_us(self) -> dict[str, float]:
        return {k: 1e6 * self.seconds[k] / self.calls[k] for k in sorted(self.seconds)}


# ---- throughput -----------------------------------------------------------------------------------
def one_round(core: ControllerCore, results: Results, timer: OpTimer, rng: random.Random) -> None:
    """Dispatch what admission allows; half of the in-flight results arrive shuffled; batch; publish."""
    while (ticket := timer.call("dispatch", core.dispatch)) is not None:
        pass
    arriving = list(core.in_flight.values())
    rng.shuffle(arriving)
    for ticket in arriving[: max(1, len(arriving) // 2)]:
        timer.call("receive_admit", core.on_result, results.make(ticket))
    batch = timer.call("batch", core.next_batch)
    if batch is not None:
        timer.call("publish", core.on_published, batch.step + 1)
        timer.call("publish", core.on_rollout_version, batch.step + 1)


def run_throughput(num_tasks: int, batch: int, steps: int, budget_s: float, seed: int) -> dict[str, Any]:
    cap = max(1, -(-3 * batch // num_tasks))  # enough slots for the admission window of 2 batches
    core = make_core(num_tasks, cap, batch, steps, seed)
    results, timer, rng = Results(seed), OpTimer(), random.Random(seed)
    while not core.done and timer.total_s < budget_s:
        one_round(core, results, timer, rng)
    trained = core.accounting()["trained"]
    return {
        "num_tasks": num_tasks,
        "max_in_flight_per_task": cap,
        "batch_size": batch,
        "steps_done": core.version,
        "trained": trained,
        "bookkeeping_s": timer.total_s,
        "trajectories_per_s": trained / timer.total_s if timer.total_s > 0 else 0.0,
        "per_op_us": timer.per_op_us(),
        "calls": dict(timer.calls),
        "balanced": core.balanced(),
    }


def profile_hot_spots(num_tasks: int, batch: int, seed: int, top: int = 12) -> list[dict[str, Any]]:
    """cProfile of a few throughput steps: the functions with the most own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run_throughput(num_tasks, batch, steps=3, budget_s=5.0, seed=seed)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}:{name}", "calls": calls, "own_s": tottime})
        rows[-1]["cum_s"] = cumtime
    return sorted(rows, key=lambda r: -r["own_s"])[:top]


# ---- in flight ------------------------------------------------------------------------------------
def _binned(samples: list[tuple[int, float]], limit: int) -> list[dict[str, float]]:
    """Mean microseconds per call by in-flight count, in NUM_BINS equal bins of [0, limit]."""
    sums = [0.0] * NUM_BINS
    counts = [0] * NUM_BINS
    for in_flight, seconds in samples:
        b = min(NUM_BINS - 1, in_flight * NUM_BINS // max(1, limit))
        sums[b] += seconds
        counts[b] += 1
    width = limit / NUM_BINS
    return [
        {"in_flight_from": i * width, "in_flight_to": (i + 1) * width, "mean_us": 1e6 * sums[i] / counts[i]}
        for i in range(NUM_BINS)
        if counts[i]
    ]


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def fill_and_drain(core: ControllerCore, results: Results, target: int, rng: random.Random) -> dict[str, Any]:
    """Fill to `target` in flight (timing dispatch and a waiting next_batch), drain in random order."""
    dispatch_t: list[tuple[int, float]] = []
    waiting_t: list[tuple[int, float]] = []
    while len(core.in_flight) < target:
        ticket, seconds = _timed(core.dispatch)
        if ticket is None:
            raise RuntimeError(f"admission stopped at {len(core.in_flight)} in flight, below {target}")
        dispatch_t.append((len(core.in_flight) - 1, seconds))
        if len(core.in_flight) % max(1, target // NUM_BINS) == 0:
            calls = [_timed(core.next_batch) for _ in range(5)]
            if any(batch is not None for batch, _ in calls):
                raise RuntimeError("next_batch returned a batch while the buffer cannot fill one")
            waiting_t.append((len(core.in_flight), min(seconds for _, seconds in calls)))
    tickets = list(core.in_flight.values())
    rng.shuffle(tickets)
    receive_t = []
    for ticket in tickets:
        traj = results.make(ticket)
        receive_t.append((len(core.in_flight), _timed(core.on_result, traj)[1]))
    return {"dispatch": dispatch_t, "next_batch_waiting": waiting_t, "receive_admit": receive_t}


def train_all(core: ControllerCore) -> int:
    """Take and publish every batch the buffer allows; returns how many steps were trained."""
    steps = 0
    while (batch := core.next_batch()) is not None:
        core.on_published(batch.step + 1)
        core.on_rollout_version(batch.step + 1)
        steps += 1
    return steps


def in_flight_core(target: int, num_tasks: int, cycles: int, seed: int) -> ControllerCore:
    cap = max(1, -(-target // num_tasks))
    # admission limit at rollout version v is (v + 2) * batch: batch = target / 2 admits `target` at once.
    return make_core(num_tasks, cap, batch=max(1, target // 2), steps=2 * cycles + 2, seed=seed)


def run_in_flight(target: int, num_tasks: int, cycles: int, seed: int) -> dict[str, Any]:
    core = in_flight_core(target, num_tasks, cycles, seed)
    samples = fill_and_drain(core, Results(seed), target, random.Random(seed))
    train_all(core)
    out: dict[str, Any] = {"in_flight": target, "num_tasks": num_tasks}
    for name, series in samples.items():
        out[f"{name}_us_by_in_flight"] = _binned(series, target)
    for name in ("dispatch", "receive_admit", "next_batch_waiting"):
        bins = out[f"{name}_us_by_in_flight"]
        out[f"{name}_growth"] = bins[-1]["mean_us"] / bins[0]["mean_us"]
    out["memory"] = measure_memory(target, num_tasks, cycles, seed)
    return out


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    import os

    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_memory(target: int, num_tasks: int, cycles: int, seed: int) -> dict[str, Any]:
    """tracemalloc over the first fill (peak, per ticket) and RSS after every fill/drain/train cycle."""
    import gc
    import tracemalloc

    core = in_flight_core(target, num_tasks, cycles, seed)
    results, rng = Results(seed), random.Random(seed)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(target):
        core.dispatch()
    filled = tracemalloc.get_traced_memory()[0] - base
    rss_by_cycle: list[int] = []
    traced_by_cycle: list[int] = []
    for cycle in range(cycles):
        if cycle:
            fill_and_drain(core, results, target, rng)
        else:
            for ticket in list(core.in_flight.values()):
                core.on_result(results.make(ticket))
        train_all(core)
        gc.collect()
        rss_by_cycle.append(rss_bytes())
        traced_by_cycle.append(tracemalloc.get_traced_memory()[0] - base)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return {
        "tracemalloc_peak_bytes": peak,
        "bytes_per_ticket_in_flight": filled / target,
        "traced_bytes_after_cycle": traced_by_cycle,
        "rss_bytes_after_cycle": rss_by_cycle,
        "rss_growth_bytes": rss_by_cycle[-1] - rss_by_cycle[0],
        "rss_steady_growth_bytes": rss_by_cycle[-1] - rss_by_cycle[1],  # after allocator warm-up
    }


# ---- entry ----------------------------------------------------------------------------------------
def parse_tasks(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--tasks: expected comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise UsageError(f"--tasks: task counts must be >= 1, got {text!r}")
    return counts


def check_args(args: argparse.Namespace) -> None:
    if args.batch < 1 or args.steps < 1 or args.in_flight < 2 or args.in_flight_tasks < 1:
        raise UsageError("--batch, --steps, --in-flight-tasks must be >= 1 and --in-flight >= 2")
    if args.budget_s <= 0 or args.cycles < 2:
        raise UsageError("--budget-s must be > 0 and --cycles >= 2 (RSS growth compares cycles)")


def headline(throughput: list[dict[str, Any]]) -> dict[str, Any]:
    """The goal judged where it is stated: the rows at `GOAL_NUM_TASKS` (None for a row not measured)."""
    by_tasks = {t["num_tasks"]: t["trajectories_per_s"] for t in throughput}
    at_goal = [by_tasks.get(n) for n in GOAL_NUM_TASKS]
    return {
        "goal_trajectories_per_s": GOAL_TRAJECTORIES_PER_S,
        "goal_num_tasks": list(GOAL_NUM_TASKS),
        "trajectories_per_s": at_goal[0],
        "trajectories_per_s_by_num_tasks": {str(n): v for n, v in by_tasks.items()},
        "meets_goal": all(v is not None and v >= GOAL_TRAJECTORIES_PER_S for v in at_goal),
    }


def goal_line(result: dict[str, Any]) -> str:
    by_tasks = result["trajectories_per_s_by_num_tasks"]
    rows = ", ".join(
        f"{n:,} tasks {by_tasks[str(n)]:,.0f}/s" if str(n) in by_tasks else f"{n:,} tasks not measured"
        for n in result["goal_num_tasks"]
    )
    verdict = "met" if result["meets_goal"] else "NOT met"
    return f"goal >= {result['goal_trajectories_per_s']:,.0f} trajectories/s: {verdict} ({rows})"


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    throughput = [
        run_throughput(n, args.batch, args.steps, args.budget_s, args.seed) for n in parse_tasks(args.tasks)
    ]
    out: dict[str, Any] = {
        **headline(throughput),
        "throughput": throughput,
        "in_flight": run_in_flight(args.in_flight, args.in_flight_tasks, args.cycles, args.seed),
    }
    if not args.no_profile:
        out["hot_spots"] = profile_hot_spots(max(parse_tasks(args.tasks)), args.batch, args.seed)
    return out


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.contracts.atomic import atomic_write_json

    result = run_bench(args)
    atomic_write_json(Path(args.json), result)
    for t in result["throughput"]:
        print(
            f"{t['num_tasks']:>6} tasks: {t['trajectories_per_s']:>10.0f} trajectories/s "
            f"({t['trained']} trained in {t['bookkeeping_s']:.2f} s), per op us {json.dumps(t['per_op_us'])}"
        )
    f = result["in_flight"]
    print(
        f"{f['in_flight']} in flight: growth dispatch {f['dispatch_growth']:.2f}x, "
        f"result {f['receive_admit_growth']:.2f}x, waiting next_batch {f['next_batch_waiting_growth']:.2f}x; "
        f"{f['memory']['bytes_per_ticket_in_flight']:.0f} B/ticket, "
        f"RSS growth {f['memory']['rss_growth_bytes'] / 2**20:.1f} MiB over "
        f"{len(f['memory']['rss_bytes_after_cycle'])} cycles, "
        f"{f['memory']['rss_steady_growth_bytes'] / 2**20:.2f} MiB after the first"
    )
    print(goal_line(result))
    print(f"wrote {args.json}")
    return 0
