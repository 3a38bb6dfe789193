"""`launch.py bench affinity --json OUT [--steps N] [--batch B] [--redundancy R] ...`: routing policies on
the same work, side by side in one process.

Set-up: two rollout pools of one rank each, each rank the real rollout loop (`rollout.main.serve`, the
built-in engine, its `StepMeter` and LOAD reports) on a thread, fed over an in-process mailbox; the env
side is the real `MPIClient` + `Router` with an episode driver in place of env workers. The task mix has
two families, half the episodes each: 'longctx' (prefill-heavy: long observations, 4-token replies) and
'shortgen' (decode-heavy: short prompts, long replies). Replies have a fixed length (no end token), so
every policy generates the same tokens.

Hardware: both pools share this machine's cores, which cannot make one prefill-rich and the other
decode-rich, so each pool runs an explicit cost profile (`roles.rollout_pools[i].prefill_cost_scale` /
`decode_cost_scale`, see `rollout/costs.py`): pool 'compute' stretches the decode share of each step by
`--slow-scale`, pool 'bandwidth' the prefill share. The JSON names it under `hardware`.

Policies: 'hash' (episode id hash over the ranks), 'static' (the declared map longctx -> compute,
shortgen -> bandwidth; least-loaded rank, fallback), 'adaptive' (starts from the same declared map and
re-chooses the shares from the measured costs every `--adapt-every-s`, exploring at routing.min_share),
'adaptive_cold' (adaptive with no map and no pool tags: starts from even shares, so it must learn the
affinity). Each runs `--steps` steps of `--batch` episodes, with and
without redundancy: a step dispatches ceil(batch x R) episodes and, once `batch` have finished, cancels
the rest (counted, with their family and tokens so far, as are those that finish after the batch is full). Throughput: finished trajectories (and their
tokens) per second of the runs' wall time; `throughput_adaptive_vs_hash` / `_vs_static` are ratios of
trajectories/s without redundancy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import queue
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rollart_hpc.cluster.mailbox import Message
from rollart_hpc.config.routing import RoutingConfig
from rollart_hpc.contracts.generation import SamplingParams
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.routing.router import PoolSpec, Router

DRIVER = 0  # the env side's rank on the in-process bus
POLICIES = ("hash", "static", "adaptive", "adaptive_cold")
FAMILY_POOL = {"longctx": "compute", "shortgen": "bandwidth"}


@dataclass(frozen=True)
class FamilyShape:
    """One synthetic family: the first prompt, each later observation, and each reply, in tokens."""

    prompt: int
    observation: int
    reply: int
    turns: int


FAMILIES = {
    "longctx": FamilyShape(prompt=240, observation=160, reply=4, turns=3),
    "shortgen": FamilyShape(prompt=16, observation=8, reply=40, turns=2),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", required=True, type=Path, help="write the results here (JSON)")
    parser.add_argument("--steps", type=int, default=3, help="steps per run")
    parser.add_argument("--batch", type=int, default=12, help="finished episodes a step needs")
    parser.add_argument("--redundancy", type=float, default=1.5, help="episodes dispatched per needed one")
    parser.add_argument("--slow-scale", type=float, default=6.0, help="cost profile of a pool's slow phase")
    parser.add_argument("--slots", type=int, default=8, help="engine slots per pool rank")
    parser.add_argument("--adapt-every-s", type=float, default=0.5, help="adaptive: decision interval")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setting (medians reported)")
    parser.add_argument("--seed", type=int, default=0)


class _Bus:
    """In-process mailboxes: one queue per rank; messages keep their order per sender and receiver."""

    def __init__(self, ranks: list[int]) -> None:
        self.queues: dict[int, queue.SimpleQueue[Message]] = {r: queue.SimpleQueue() for r in ranks}

    def mailbox(self, rank: int) -> _LocalMailbox:
        return _LocalMailbox(self, rank)


class _LocalMailbox:
    def __init__(self, bus: _Bus, rank: int) -> None:
        self.bus, self.rank = bus, rank

    def poll(self) -> list[Message]:
        out, q = [], self.bus.queues[self.rank]
        while not q.empty():
            out.append(q.get())
        return out

    def send(self, payload: Any, dest: int, tag: Tag) -> None:
        self.bus.queues[dest].put(Message(self.rank, tag, payload))

    def check(self) -> None:
        """Liveness of peers: every peer is a thread of this process, so there is nothing to watch."""

    def flush(self) -> None:
        """`send` puts the message in its queue at once: nothing is buffered to flush."""


def pool_settings(slow: float, slots: int) -> dict[str, dict[str, Any]]:
    return {
        "compute": {"rank": 1, "num_slots": slots, "prefill_cost_scale": 1.0, "decode_cost_scale": slow},
        "bandwidth": {"rank": 2, "num_slots": slots, "prefill_cost_scale": slow, "decode_cost_scale": 1.0},
    }


def start_rollouts(model_dir: Path, pools: dict[str, dict[str, Any]], bus: _Bus, run_dir: Path) -> list[Any]:
    """One rollout thread per pool: the real rank loop over a fresh built-in engine."""
    from rollart_hpc.inference.engine import LLMEngine
    from rollart_hpc.rollout.costs import CostProfile, StepMeter
    from rollart_hpc.rollout.main import serve

    threads = []
    for name, p in pools.items():
        engine = LLMEngine.from_pretrained(
            model_dir, num_slots=p["num_slots"], max_model_len=1024, eos_token_ids=[]
        )
        meter = StepMeter(CostProfile(p["prefill_cost_scale"], p["decode_cost_scale"]))
        ctx = SimpleNamespace(
            mailbox=bus.mailbox(p["rank"]), world=SimpleNamespace(rank=p["rank"]), run_dir=run_dir
        )
        thread = threading.Thread(target=serve, args=(ctx, engine, None, name, meter), daemon=True)
        thread.start()
        threads.append(thread)
    return threads


async def run_episode(
    client: Any, episode_id: str, family: str, rng: random.Random, vocab: int
) -> dict[str, Any]:
    shape = FAMILIES[family]
    prompt = [rng.randrange(3, vocab) for _ in range(shape.prompt)]
    generated = 0
    client.router.begin(episode_id, family, (family,))
    try:
        for turn in range(shape.turns):
            sampling = SamplingParams(max_tokens=shape.reply, temperature=1.0)
            out = await client.generate(f"{episode_id}/t{turn}", prompt, sampling)
            if out.finish_reason in ("abort", "error"):
                return {"family": family, "ok": False, "tokens": len(prompt) + generated, "turns": turn}
            generated += len(out.token_ids)
            prompt = prompt + out.token_ids + [rng.randrange(3, vocab) for _ in range(shape.observation)]
    finally:
        client.router.end(episode_id)
        client.cancelled.discard(episode_id)
    return {"family": family, "ok": True, "tokens": len(prompt) - shape.observation, "turns": shape.turns}


async def pump(client: Any, mailbox: _LocalMailbox, stop: asyncio.Event, decisions: list[Any]) -> None:
    while not stop.is_set():
        for msg in mailbox.poll():
            if msg.tag == Tag.LOAD:
                client.router.on_load(msg.payload)
            elif msg.tag == Tag.OUTPUT:
                client.resolve(msg.payload)
        record = client.router.maybe_adapt()
        if record is not None:
            decisions.append(record)
        await asyncio.sleep(0.0005)


async def run_steps(client: Any, args: argparse.Namespace, redundancy: float, vocab: int) -> dict[str, Any]:
    rng, index = random.Random(args.seed), 0
    done: list[dict[str, Any]] = []
    cancelled: list[dict[str, Any]] = []
    step_s: list[float] = []
    families = sorted(FAMILIES)
    for _ in range(args.steps):
        start = time.perf_counter()
        tasks = []
        for _ in range(math.ceil(args.batch * redundancy - 1e-9)):
            episode_id = f"ep{index:05d}"
            family = families[index % len(families)]
            tasks.append(
                (episode_id, asyncio.create_task(run_episode(client, episode_id, family, rng, vocab)))
            )
            index += 1
        batch: list[dict[str, Any]] = []
        for next_done in asyncio.as_completed([t for _, t in tasks]):
            result = await next_done
            if result["ok"]:
                batch.append(result)
                if len(batch) == args.batch:
                    break
        step_s.append(time.perf_counter() - start)
        for episode_id, task in tasks:
            if not task.done():
                client.cancel(episode_id)
        await asyncio.gather(*(t for _, t in tasks))
        done.extend(batch)
        # the rest: cancelled, or finished after the batch was full (a controller drops those too)
        cancelled.extend(r for r in (t.result() for _, t in tasks) if all(r is not b for b in batch))
    return {"done": done, "cancelled": cancelled, "step_s": step_s}


async def one_run(
    args: argparse.Namespace, model_dir: Path, policy: str, redundancy: float, run_dir: Path, vocab: int
) -> dict[str, Any]:
    from rollart_hpc.envs.main import MPIClient

    pools = pool_settings(args.slow_scale, args.slots)
    bus = _Bus([DRIVER, *(p["rank"] for p in pools.values())])
    threads = start_rollouts(model_dir, pools, bus, run_dir)
    routing = RoutingConfig(
        policy="adaptive" if policy == "adaptive_cold" else policy,  # type: ignore[arg-type]
        families={} if policy in ("hash", "adaptive_cold") else dict(FAMILY_POOL),
        adapt_every_s=args.adapt_every_s,
    )
    specs = [
        PoolSpec(name, (p["rank"],), p["num_slots"], () if policy == "adaptive_cold" else (f,))
        for f, name in FAMILY_POOL.items()
        for p in [pools[name]]
    ]
    client = MPIClient(bus.mailbox(DRIVER), args.seed, Router(routing, specs))  # type: ignore[arg-type]
    stop, decisions = asyncio.Event(), []  # type: ignore[var-annotated]
    pumping = asyncio.create_task(pump(client, bus.mailbox(DRIVER), stop, decisions))
    start = time.perf_counter()
    try:
        steps = await run_steps(client, args, redundancy, vocab)
    finally:
        wall = time.perf_counter() - start
        stop.set()
        await pumping
        for p in pools.values():
            bus.mailbox(DRIVER).send("bench done", p["rank"], Tag.STOP)
        for thread in threads:
            thread.join(timeout=60)
    return summarise(policy, redundancy, wall, steps, client.router, decisions)


def summarise(
    policy: str, redundancy: float, wall: float, steps: dict[str, Any], router: Router, decisions: list[Any]
) -> dict[str, Any]:
    done, cancelled = steps["done"], steps["cancelled"]
    by_family: dict[str, int] = {}
    for r in done:
        by_family[r["family"]] = by_family.get(r["family"], 0) + 1
    cancelled_by_family: dict[str, int] = {}
    for r in cancelled:
        cancelled_by_family[r["family"]] = cancelled_by_family.get(r["family"], 0) + 1
    return {
        "policy": policy,
        "redundancy": redundancy,
        "wall_s": round(wall, 3),
        "trajectories": len(done),
        "trajectories_per_s": round(len(done) / wall, 4),
        "tokens_per_s": round(sum(r["tokens"] for r in done) / wall, 1),
        "step_s": [round(s, 3) for s in steps["step_s"]],
        "mean_step_s": round(sum(steps["step_s"]) / len(steps["step_s"]), 3),
        "finished_by_family": by_family,
        "cancelled": len(cancelled),
        "cancelled_by_family": cancelled_by_family,
        "cancelled_tokens": sum(r["tokens"] for r in cancelled),
        "pools": router.metrics(),
        "decisions": decisions,
    }


def hardware(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "method": "cost_profile",
        "why": "both pools share this machine's cores: core counts and threads cannot make one pool "
        "prefill-rich and the other decode-rich, so each pool stretches one phase of every engine step",
        "pools": {
            name: {k: v for k, v in p.items() if k != "rank"}
            for name, p in pool_settings(args.slow_scale, args.slots).items()
        },
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }


def main(args: argparse.Namespace) -> int:
    import torch

    from rollart_hpc.models.tiny import make_tiny_model

    torch.set_num_threads(1)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = make_tiny_model(Path(scratch) / "model", hidden_size=128, num_layers=2, vocab_size=512)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        for repeat in range(args.repeats):  # alternate the order, so drifting machine load hits all alike
            order = [(r, p) for r in (1.0, args.redundancy) for p in POLICIES]
            for redundancy, policy in order if repeat % 2 == 0 else order[::-1]:
                result = asyncio.run(one_run(args, model_dir, policy, redundancy, Path(scratch), vocab))
                result["repeat"] = repeat
                print(
                    f"[affinity] {policy:<13} redundancy {redundancy}: {result['trajectories_per_s']} traj/s, "
                    f"{result['tokens_per_s']} tok/s, step {result['mean_step_s']} s",
                    flush=True,
                )
                runs.append(result)
    out = report(args, runs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k.startswith("throughput")}, indent=1))
    return 0


def medians(runs: list[dict[str, Any]], key: str) -> dict[tuple[str, float], float]:
    values: dict[tuple[str, float], list[float]] = {}
    for r in runs:
        values.setdefault((r["policy"], r["redundancy"]), []).append(float(r[key]))
    return {k: statistics.median(v) for k, v in values.items()}


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    rate, tokens, step = (medians(runs, k) for k in ("trajectories_per_s", "tokens_per_s", "mean_step_s"))
    base = 1.0

    def ratio(a: str, b: str) -> float:
        return round(rate[(a, base)] / rate[(b, base)], 3)

    return {
        "throughput_adaptive_vs_hash": ratio("adaptive", "hash"),
        "throughput_adaptive_vs_static": ratio("adaptive", "static"),
        "throughput_static_vs_hash": ratio("static", "hash"),
        "throughput_adaptive_cold_vs_hash": ratio("adaptive_cold", "hash"),
        "throughput_adaptive_cold_vs_static": ratio("adaptive_cold", "static"),
        "redundancy_speedup": {p: round(rate[(p, args.redundancy)] / rate[(p, base)], 3) for p in POLICIES},
        "medians": {
            f"{p}@{r}": {
                "trajectories_per_s": rate[(p, r)],
                "tokens_per_s": tokens[(p, r)],
                "step_s": step[(p, r)],
            }
            for p, r in rate
        },
        "hardware": hardware(args),
        "families": {f: vars(s) for f, s in FAMILIES.items()},
        "settings": {k: v for k, v in vars(args).items() if k != "json" and not k.startswith("_")},
        "runs": runs,
    }
