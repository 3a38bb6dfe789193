"""Run under mpiexec by tests/test_weights_mpi.py: python weights_check.py TIMEOUT OUT_DIR.

Rank 0 is the publishing trainer, ranks 1-2 are rollout ranks. One world runs every check in turn (each
on its own group; the silent-receiver check breaks its group, so it runs last); each rank writes
rank-<r>.json with one entry per check.
"""

import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from rollart_hpc.cluster.env import read_process_env
from rollart_hpc.cluster.plan import RoleRange, RunPlan
from rollart_hpc.cluster.world import make_world
from rollart_hpc.contracts.errors import PeerTimeoutError
from rollart_hpc.weights.buckets import layout_for
from rollart_hpc.weights.group import make_standalone_group
from rollart_hpc.weights.notify import announce, poll_announcement
from rollart_hpc.weights.publisher import WeightPublisher, WeightReceiver

TAG_DONE = 77


def model(version: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes, a scalar, an empty tensor and one tensor larger than the small buckets."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(64, generator=g).to(torch.float16),
        "model.layers.0.mlp.counter": torch.randint(0, 1 << 40, (7,), generator=g),
        "model.layers.0.mask": torch.rand(13, generator=g) > 0.5,
        "model.scale": torch.randn((), generator=g),
        "model.empty": torch.empty(0, 5),
        "lm_head.weight": torch.randn(3, 1, 11, generator=g, dtype=torch.float64),
    }


def digest(named) -> dict[str, str]:
    return {
        n: hashlib.sha256(
            t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        ).hexdigest()
        + f"|{tuple(t.shape)}|{t.dtype}"
        for n, t in named
    }


def roundtrip(world, group, result):
    result["runs"] = []
    for bucket_bytes, checksum in ((256, False), (4096, True), (1 << 20, False)):
        run = {"bucket_bytes": bucket_bytes, "versions": {}}
        if world.rank == 0:
            pub = WeightPublisher(group, layout_for(model(0).items(), bucket_bytes), checksum=checksum)
            run["num_buckets"] = pub.layout.num_buckets
            for version in (1, 2, 3):
                announce(world, [1, 2], version)
                named = model(version)
                pub.publish(version, named)
                run["versions"][version] = digest(model(version).items())
                for t in named.values():  # the caller may step on at once: the snapshot is already taken
                    t.zero_() if t.dtype != torch.bool else t.logical_not_()
            pub.wait()
        else:
            rec = WeightReceiver(group, 0)
            run["num_buckets"] = rec.layout.num_buckets
            for _ in range(3):
                announced = None
                while announced is None:
                    announced = poll_announcement(world, 0)
                version, named = rec.receive()
                assert version == announced
                run["versions"][version] = digest(named)
        result["runs"].append(run)


def nonblocking(world, group, result):
    big = {f"layer.{i}.weight": torch.full((1 << 20,), float(i)) for i in range(8)}  # 32 MiB
    if world.rank == 0:
        pub = WeightPublisher(group, layout_for(big.items(), 4 << 20))
        start = time.monotonic()
        pub.publish(7, big)
        result["publish_s"] = time.monotonic() - start
        result["in_flight_after_publish"] = pub.in_flight
        pub.wait()
        result["delivered_s"] = time.monotonic() - start
    else:
        rec = WeightReceiver(group, 0)
        time.sleep(1.5)
        version, named = rec.receive()
        result["ok"] = version == 7 and all(bool((t == float(n.split(".")[1])).all()) for n, t in named)


def silent(world, group, result):
    named = {"w": torch.ones(1000)}
    if world.rank == 0:
        pub = WeightPublisher(group, layout_for(named.items(), 1 << 20))
        start = time.monotonic()
        pub.publish(1, named)
        try:
            pub.wait()
        except PeerTimeoutError as exc:
            result["error"] = str(exc)
        result["elapsed_s"] = time.monotonic() - start
        for peer in (1, 2):
            world.send("done", peer, TAG_DONE)
    else:
        rec = WeightReceiver(group, 0)
        if world.rank == 1:
            try:
                rec.receive()
                result["received"] = True
            except PeerTimeoutError as exc:
                result["error"] = str(exc)
        world.recv(0, TAG_DONE, timeout_s=60)


def main() -> None:
    timeout, out_dir = float(sys.argv[1]), Path(sys.argv[2])
    plan = RunPlan((RoleRange("trainer", 0, 1, ""), RoleRange("rollout", 1, 2, "")))
    world = make_world(plan, read_process_env(), timeout)
    results: dict = {"rank": world.rank}
    for name, check in (("roundtrip", roundtrip), ("nonblocking", nonblocking), ("silent", silent)):
        group = make_standalone_group(world, [0, 1, 2], "gloo", timeout)
        results[name] = {"member": group.member}
        check(world, group, results[name])
        if name != "silent":
            group.close()
    (out_dir / f"rank-{world.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
