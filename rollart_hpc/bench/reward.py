"""`launch.py bench reward --json OUT`: dedicated always-on reward workers vs one shared elastic reward
service, for several concurrent runs with bursty reward phases.

Workload: `--runs` client streams (one per emulated run). Each run alternates a reward phase (a burst of
`--burst` finished trajectories arriving at random over `--burst-s` seconds, as a step's trajectories
finish) and a gap of `--gap-s` seconds (generation and training, no reward work); the runs' phases are
staggered. Each trajectory is a real calc_math reward input (right or wrong answer at random), sent by
a real `ServiceClient` to a real `RewardService` and scored by the real reward function in a spawned
worker process. The same seeded schedule is played twice in this one invocation, one setting after the
other (so they never compete for cores):
- dedicated: one service per run, one always-on worker each (started before the clock starts);
- shared: one service for all runs, elastic: `--max-workers` workers at most, started under load (cold
  starts, counted and timed), stopped after `--idle-s` idle (scale to zero).
Reported per setting: worker-seconds (workers alive, summed over workers, over the schedule), busy
seconds, utilisation (busy / alive), wait for a score (request sent -> reply, mean and p95), cold starts
and their latency. Headline: `worker_seconds_shared_vs_dedicated` (shared / dedicated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the service stack (zmq) is imported when the bench runs, not for `--help`
    from rollart_hpc.reward.client import ServiceClient


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", required=True, help="write the results here (JSON)")
    parser.add_argument("--runs", type=int, default=3, help="concurrent emulated runs (client streams)")
    parser.add_argument("--phases", type=int, default=4, help="reward phases per run")
    parser.add_argument("--burst", type=int, default=16, help="trajectories per reward phase")
    parser.add_argument("--burst-s", type=float, default=0.3, help="seconds over which a burst arrives")
    parser.add_argument("--gap-s", type=float, default=3.0, help="seconds between a run's reward phases")
    parser.add_argument("--max-workers", type=int, default=3, help="most workers of the shared service")
    parser.add_argument("--idle-s", type=float, default=0.5, help="idle seconds before a shared worker stops")
    parser.add_argument("--seed", type=int, default=0, help="seed of the schedule and the answers")


Arrival = tuple[float, int, str, dict[str, Any]]  # (time, run, request id, input)


def schedule(args: argparse.Namespace) -> list[Arrival]:
    """Arrival times of every trajectory, sorted; run k's phases start at k * gap / runs + p * gap."""
    from rollart_hpc.reward.functions import RewardInput
    from rollart_hpc.reward.wire import input_to_dict
    from rollart_hpc.tasks.families.calc_math import generate_problem

    rng = random.Random(args.seed)
    out: list[Arrival] = []
    for run in range(args.runs):
        for phase in range(args.phases):
            start = run * args.gap_s / args.runs + phase * args.gap_s
            for i in range(args.burst):
                index = rng.randrange(1000)
                gold = generate_problem(index).answer
                answer = gold if rng.random() < 0.5 else gold + 1
                inp = RewardInput(
                    f"calc_math/{index:04d}", "calc_math", (f"<answer>{answer}</answer>",), 0.0, False
                )
                out.append(
                    (start + rng.uniform(0, args.burst_s), run, f"{run}-{phase}-{i}", input_to_dict(inp))
                )
    return sorted(out, key=lambda a: a[0])


async def play(arrivals: list[Arrival], clients: list[ServiceClient]) -> float:
    """Send every request at its arrival time; wall seconds until the last reply."""
    start = time.monotonic()
    tasks = []
    for at, run, rid, inp in arrivals:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        tasks.append(asyncio.create_task(clients[run].request(rid, inp)))
    replies = await asyncio.gather(*tasks)
    bad = [r for r in replies if r["status"] != "ok"]
    if bad:
        raise RuntimeError(f"{len(bad)} reward requests failed, first: {bad[0]}")
    return time.monotonic() - start


async def measure(
    args: argparse.Namespace, arrivals: list[Arrival], shared: bool, root: Path
) -> dict[str, Any]:
    from rollart_hpc.config.schema import RewardConfig
    from rollart_hpc.reward.client import ServiceClient
    from rollart_hpc.reward.service import RewardService

    if shared:
        cfgs = [RewardConfig(max_workers=args.max_workers, idle_shutdown_s=args.idle_s)]
    else:
        cfgs = [RewardConfig(max_workers=1, idle_shutdown_s=1e9) for _ in range(args.runs)]
    services = [
        RewardService(cfg, root / f"{'shared' if shared else 'dedicated'}-{i}") for i, cfg in enumerate(cfgs)
    ]
    runners = [asyncio.create_task(s.run(stats_every_s=5.0)) for s in services]
    clients = [
        ServiceClient(RewardConfig(service_dir=str(services[0 if shared else run].dir)), f"run-{run}")
        for run in range(args.runs)
    ]
    if not shared:  # always-on: each worker is up before the clock starts
        for run, client in enumerate(clients):
            await client.request(f"warm-{run}", arrivals[0][3])
    before = [(s.pool.worker_seconds(), s.pool.stats()["busy_s"], len(s.pool.cold_start_s)) for s in services]
    wall = await play(arrivals, clients)
    worker_s = sum(s.pool.worker_seconds() - b[0] for s, b in zip(services, before, strict=True))
    busy_s = sum(s.pool.stats()["busy_s"] - b[1] for s, b in zip(services, before, strict=True))
    cold = [c for s, b in zip(services, before, strict=True) for c in s.pool.cold_start_s[b[2] :]]
    waits = sorted(w for c in clients for w in c.reply_s[1 if not shared else 0 :])
    peak = max(s.pool.peak_workers for s in services)
    for client in clients:
        client.close()
    for service in services:
        service.stop()
    await asyncio.gather(*runners)
    return {
        "wall_s": wall,
        "worker_s": worker_s,
        "busy_s": busy_s,
        "utilisation": busy_s / worker_s if worker_s else 0.0,
        "wait_s_mean": sum(waits) / len(waits),
        "wait_s_p95": waits[int(0.95 * (len(waits) - 1))],
        "cold_starts": len(cold),
        "cold_start_s_mean": sum(cold) / len(cold) if cold else 0.0,
        "cold_start_s_max": max(cold, default=0.0),
        "peak_workers": peak,
    }


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.contracts.atomic import atomic_write_json

    arrivals = schedule(args)
    with tempfile.TemporaryDirectory(prefix="bench-reward-") as tmp:
        dedicated = asyncio.run(measure(args, arrivals, shared=False, root=Path(tmp)))
        shared = asyncio.run(measure(args, arrivals, shared=True, root=Path(tmp)))
    result = {
        "setting": {
            k: v
            for k, v in vars(args).items()
            if not k.startswith("_") and k not in ("json", "command", "bench")
        },
        "requests": len(arrivals),
        "worker_seconds_shared_vs_dedicated": shared["worker_s"] / dedicated["worker_s"],
        "utilisation_shared": shared["utilisation"],
        "utilisation_dedicated": dedicated["utilisation"],
        "wait_s_mean_shared": shared["wait_s_mean"],
        "wait_s_mean_dedicated": dedicated["wait_s_mean"],
        "cold_start_s_mean": shared["cold_start_s_mean"],
        "shared": shared,
        "dedicated": dedicated,
    }
    atomic_write_json(Path(args.json), result)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))
    return 0
