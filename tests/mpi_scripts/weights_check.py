"""Run under mpiexec by tests/test_weights_mpi.py: python weights_check.py TIMEOUT OUT_DIR.

Rank 0 is the publishing trainer, ranks 1-2 are rollout ranks. One world runs every check in turn (each
on its own group; the silent-receiver check breaks its group, so it runs last); each rank writes
rank-<r>.json with one entry per check.
"""

import functools
import json
import sys
import time
from pathlib import Path

import torch
from weights_contract import collect, model, receive_versions, send_versions

from rollart_hpc.cluster.env import read_process_env
from rollart_hpc.cluster.plan import RoleRange, RunPlan
from rollart_hpc.cluster.world import make_world
from rollart_hpc.contracts.errors import PeerTimeoutError
from rollart_hpc.weights.buckets import layout_for
from rollart_hpc.weights.group import make_standalone_group
from rollart_hpc.weights.publisher import WeightPublisher, WeightReceiver
from rollart_hpc.weights.transport import announce_to, open_publisher

TAG_DONE = 77
TAG_VERSION = 78


def roundtrip(world, group, result):
    """The transport contract (weights_contract.py) over the group transport, announced over MPI."""
    result["runs"] = []
    for bucket_bytes, checksum, snapshot, stream, direct_bytes in (
        (256, False, True, False, 0), (4096, True, True, False, 0), (1 << 20, False, True, False, 0),
        (4096, True, False, False, 0), (256, False, False, False, 0), (256, True, True, True, 0),
        (1 << 20, True, False, False, 1024),
    ):  # fmt: skip
        run = {"bucket_bytes": bucket_bytes, "snapshot": snapshot, "stream": stream}
        if world.rank == 0:
            announce = announce_to(world, [1, 2], TAG_VERSION)
            sender = open_publisher(
                group, model(0), bucket_bytes / 2**20, announce, checksum, direct_mb=direct_bytes / 2**20
            )
            run["num_buckets"] = sender.layout.num_buckets
            run["versions"] = send_versions(sender, snapshot, stream)
            run["direct_sends"] = sender.direct_sends
        else:
            source = WeightReceiver(group, 0)
            run["num_buckets"] = source.layout.num_buckets
            run["versions"] = receive_versions(
                functools.partial(collect, source), lambda: int(world.recv(0, TAG_VERSION))
            )
        result["runs"].append(run)


JOIN_LATE_S = 3.0  # the receivers join this late: publish must return long before
NONBLOCKING_TIMEOUT_S = 20.0  # the late join must stay well inside the group's timeout, even under load


def nonblocking(world, group, result):
    big = {f"layer.{i}.weight": torch.full((1 << 20,), float(i)) for i in range(8)}  # 32 MiB
    if world.rank == 0:
        # Every bucket in flight at once (the sender holds the whole model): publish need not wait for them.
        pub = WeightPublisher(group, layout_for(big.items(), 4 << 20), depth=len(big))
        start = time.monotonic()
        pub.publish(7, big)
        result["publish_s"] = time.monotonic() - start
        result["in_flight_after_publish"] = pub.in_flight
        pub.wait()
        result["delivered_s"] = time.monotonic() - start
    else:
        rec = WeightReceiver(group, 0)
        time.sleep(JOIN_LATE_S)
        version, named = collect(rec)
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
        group_timeout = NONBLOCKING_TIMEOUT_S if name == "nonblocking" else timeout
        group = make_standalone_group(world, [0, 1, 2], "gloo", group_timeout)
        results[name] = {"member": group.member}
        check(world, group, results[name])
        # Closed on every path, the broken one too: shutting gloo down joins its threads, which drop their
        # tensors only once their own deadline passes; a group left to interpreter exit would drop them
        # while Python finalises (terminate() in the gloo thread, the rank aborts).
        group.close()
    (out_dir / f"rank-{world.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
