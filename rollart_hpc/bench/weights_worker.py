"""One rank of the weight-sync benchmark world (started by `rollart_hpc.bench.weights` under mpiexec).

Rank 0 publishes, ranks 1..R receive, all in one standalone group. Per size and repetition, after an
MPI barrier, rank 0 notes the wall clock and runs one of two transfers of the same bytes:
- ours: `WeightPublisher.publish` (or, with `stream`, `publish_stream` one tensor at a time, as the
  trainer publishes its units) + `wait`; each receiver's `receive(on_bucket, into=staged)` lands the
  tensors that have a bucket of their own (the layout's `direct_bytes`) straight in a staged parameter
  dict and copies every other bucket, as soon as it lands, into it while the next buckets are on the
  wire, then swaps the staged dict with the active one (no forward would mix versions: a
  double-buffered consumer, e.g. an engine that keeps plain weight tensors). The receiver's pause is
  the time from the last bucket landing to the swap done; the trainer is blocked for the time `publish` takes;
  `tensors_held_s` is when `wait_packed` returns (the trainer may change its tensors);
- raw: one broadcast of a flat uint8 buffer of the layout's total size.
Each receiver reports the wall clock at which it holds the data; the transfer time is the latest of
those minus rank 0's start (all ranks share one node clock in a local world). Usage:
python -m rollart_hpc.bench.weights_worker CONFIG_JSON OUT_JSON
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rollart_hpc.cluster.env import read_process_env
from rollart_hpc.cluster.plan import RoleRange, RunPlan
from rollart_hpc.cluster.world import World, make_world
from rollart_hpc.weights.buckets import layout_for, lone_slot
from rollart_hpc.weights.group import StandaloneGroup, make_standalone_group
from rollart_hpc.weights.publisher import WeightPublisher, WeightReceiver

DTYPE = torch.bfloat16


def _shape(numel: int, hidden: int) -> tuple[int, int]:
    return (numel // hidden, hidden) if numel >= hidden else (1, numel)


def synthetic_model(nbytes: int, device: str) -> dict[str, torch.Tensor]:
    """HF-named bf16 tensors of `nbytes` in total: per layer attention, MLP and two norms."""
    hidden = 1024 if nbytes >= 64_000_000 else 256
    pattern = [("input_layernorm.weight", 1), ("self_attn.qkv_proj.weight", 3 * hidden),
               ("self_attn.o_proj.weight", hidden), ("post_attention_layernorm.weight", 1),
               ("mlp.gate_up_proj.weight", 8 * hidden), ("mlp.down_proj.weight", hidden)]  # fmt: skip
    named: dict[str, torch.Tensor] = {}
    left, layer = nbytes // DTYPE.itemsize, 0
    while left > 0:
        for suffix, rows in pattern:
            if left > 0:
                tensor = torch.empty(_shape(min(rows * hidden, left), hidden), dtype=DTYPE, device=device)
                named[f"model.layers.{layer}.{suffix}"] = tensor
                left -= tensor.numel()
        layer += 1
    return named


def fill(named: dict[str, torch.Tensor], version: int) -> None:
    for index, tensor in enumerate(named.values()):
        tensor.fill_(version + index % 97 / 128)


def check(named: dict[str, torch.Tensor], version: int) -> None:
    for index, (name, tensor) in enumerate(named.items()):
        expected = torch.tensor(version + index % 97 / 128, dtype=DTYPE, device=tensor.device)
        if tensor.view(-1)[0] != expected or tensor.view(-1)[-1] != expected:
            raise RuntimeError(f"{name}: wrong contents after weights v{version}")


def time_ours(
    world: World, side: Any, models: list[dict[str, torch.Tensor]], version: int, config: dict[str, Any]
) -> dict[str, float]:  # fmt: skip
    """One publish; receivers stage each bucket as it lands (lone buckets straight in the staged copy)."""
    world.barrier()
    if world.rank == 0:
        return _publish_once(side, models[0], version, config["snapshot"], config.get("stream", False))
    landed: list[float] = []
    copy_s = [0.0]
    staged = models[1]

    def stage(views: list[tuple[str, torch.Tensor]]) -> None:
        landed.append(time.time())
        for name, view in views:
            if view.data_ptr() != staged[name].data_ptr():  # not landed in place
                staged[name].copy_(view)
        copy_s[0] += time.time() - landed[-1]

    got = side.receive(stage, into=side.landable(staged))
    returned = time.time()
    # The last bucket landed when `on_bucket` saw it, or (landed in place: no call) when receive returned.
    last_in_place = lone_slot(side.layout, side.layout.num_buckets - 1) is not None
    last_landed = returned if last_in_place or not landed else landed[-1]
    models.reverse()  # the swap: the staged copy becomes the active one
    done = time.time()
    check(models[0], got)
    return {"done": done, "pause_s": done - last_landed, "copy_s": copy_s[0]}


def _publish_once(
    side: Any, named: dict[str, torch.Tensor], version: int, snapshot: bool, stream: bool = False
) -> dict[str, float]:
    fill(named, version)
    start = time.time()
    if stream:  # as the trainer: one unit (here one tensor) at a time
        side.publish_stream(version, ({name: tensor} for name, tensor in named.items()))
    else:
        side.publish(version, named, snapshot=snapshot)
    published = time.time()
    side.wait_packed()
    packed = time.time()
    side.wait()
    return {"start": start, "publish_return_s": published - start, "packed_s": packed - start}


def time_raw(world: World, group: StandaloneGroup, flat: torch.Tensor) -> dict[str, float]:
    world.barrier()
    start = time.time()
    group.broadcast(flat, 0, "raw flat broadcast")
    return {"start": start} if world.rank == 0 else {"done": time.time()}


def bench_size(
    world: World, group: StandaloneGroup, config: dict[str, Any], nbytes: int
) -> dict[str, Any] | None:
    device = "cuda" if config["backend"] == "nccl" else "cpu"
    named = synthetic_model(nbytes, device)
    if world.rank == 0:
        layout = layout_for(named.items(), config["bucket_bytes"], config.get("direct_bytes") or None)
        side: Any = WeightPublisher(group, layout)
    else:
        side = WeightReceiver(group, 0)
    flat = torch.zeros(side.layout.total_nbytes, dtype=torch.uint8, device=device)
    models = [named] if world.rank == 0 else [named, {n: torch.empty_like(t) for n, t in named.items()}]
    ours: list[Any] = []
    raw: list[Any] = []
    for rep in range(config["repeats"] + 1):  # the first repetition warms the connections up
        ours.append(world.gather_to_root(time_ours(world, side, models, 2 * rep + 1, config)))
        raw.append(world.gather_to_root(time_raw(world, group, flat)))
    if world.rank != 0:
        return None
    row = summarise(nbytes, side.layout, ours[1:], raw[1:])
    return row


def _span(rep: list[dict[str, float]]) -> float:
    """From the publisher's start to the last receiver holding the data."""
    return max(r["done"] for r in rep[1:]) - rep[0]["start"]


def summarise(nbytes: int, layout: Any, ours: list[Any], raw: list[Any]) -> dict[str, Any]:
    ours_s = statistics.median(_span(rep) for rep in ours)
    raw_s = statistics.median(_span(rep) for rep in raw)
    blocked_s = statistics.median(rep[0]["publish_return_s"] for rep in ours)
    return {
        "bytes": nbytes,
        "num_tensors": len(layout.slots),
        "num_buckets": layout.num_buckets,
        "ours_s": ours_s,
        "raw_s": raw_s,
        "ours_gb_s": nbytes / ours_s / 1e9,
        "raw_gb_s": nbytes / raw_s / 1e9,
        "ratio_vs_raw": raw_s / ours_s,
        "receiver_pause_s": statistics.median(max(r["pause_s"] for r in rep[1:]) for rep in ours),
        "receiver_copy_s": statistics.median(max(r["copy_s"] for r in rep[1:]) for rep in ours),
        "publish_return_s": blocked_s,
        "trainer_blocked_s": blocked_s,
        "trainer_blocked_fraction": blocked_s / ours_s,
        "tensors_held_s": statistics.median(rep[0]["packed_s"] for rep in ours),
    }


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    num_ranks = int(read_process_env().launcher_size or 2)
    plan = RunPlan((RoleRange("trainer", 0, 1, ""), RoleRange("rollout", 1, num_ranks - 1, "")))
    world = make_world(plan, read_process_env(), config["timeout_s"])
    group = make_standalone_group(world, list(range(num_ranks)), config["backend"], config["timeout_s"])
    rows = [bench_size(world, group, config, nbytes) for nbytes in config["sizes_bytes"]]
    group.close()
    if world.rank == 0:
        result = {"bucket_bytes": config["bucket_bytes"], "direct_bytes": config.get("direct_bytes"),
                  "backend": config["backend"], "sizes": rows,
                  "repeats": config["repeats"], "snapshot": config["snapshot"], "torch": torch.__version__, "threads": torch.get_num_threads()}  # fmt: skip
        Path(sys.argv[2]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
