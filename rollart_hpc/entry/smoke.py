"""The smoke job: every role pair exchanges real messages, and a tensor travels trainer -> rollout ranks.

1. `num_rounds` heartbeat rounds: every rank sends a heartbeat to every other rank over MPI and receives
   one from each (so every role pair talks), each receive bounded by the peer timeout.
2. The first trainer broadcasts a seeded tensor over the torch `weights` group; each rollout rank checks
   the checksum.
3. A barrier; each rank logs one line with its role and rank.
"""

from __future__ import annotations

import time
from pathlib import Path

from rollart_hpc.cluster.world import World
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.metrics.log import rank_logger


def heartbeats(world: World, num_rounds: int) -> int:
    """Exchange heartbeats with every other rank; returns how many were received."""
    peers = [r for r in range(world.plan.world_size) if r != world.rank]
    received = 0
    for round_index in range(num_rounds):
        requests = [
            world.comm.isend((world.rank, round_index), dest=p, tag=Tag.SMOKE_HEARTBEAT) for p in peers
        ]
        for peer in peers:
            sender, got_round = world.recv(peer, Tag.SMOKE_HEARTBEAT)
            if (sender, got_round) != (peer, round_index):
                raise RuntimeError(
                    f"{world.me}: heartbeat out of order from rank {peer}: {sender}, {got_round}"
                )
            received += 1
        for peer, request in zip(peers, requests, strict=True):
            world.wait_request(request, peer, "heartbeat send")
    return received


def tensor_broadcast(world: World, config: Config) -> float | None:
    """Broadcast a seeded tensor from the first trainer to rollout ranks; returns the checksum seen here."""
    import torch

    from rollart_hpc.cluster.torchdist import destroy_torch_groups, init_torch_groups

    groups = init_torch_groups(world, config.cluster.torch_backend)
    checksum = None
    try:
        if world.role in ("trainer", "rollout"):
            src = world.plan.ranks_of("trainer")[0]
            expected = torch.arange(config.smoke.tensor_numel, dtype=torch.float32) * (config.run.seed + 1)
            tensor = expected.clone() if world.rank == src else torch.zeros_like(expected)
            groups.broadcast(tensor, src, groups.weights, groups.weights_ranks)
            if not torch.equal(tensor, expected):
                raise RuntimeError(f"{world.me}: broadcast tensor differs from the trainer's")
            checksum = float(tensor.sum())
    except BaseException:
        destroy_torch_groups()
        raise
    world.barrier()  # rank 0 serves the groups' store: it must not leave while a peer still uses it
    destroy_torch_groups()
    return checksum


def main(config: Config, world: World, run_dir: Path) -> None:
    log = rank_logger(world.role, world.rank, run_dir)
    smoke = config.smoke
    if world.rank == smoke.silent_rank:
        log.info("test option smoke.silent_rank: staying silent")
        time.sleep(10 * config.cluster.peer_timeout_s)
    if smoke.fail_rank >= 0:
        world.barrier()  # every rank is up, its pid file written, when the failure ends the world
    if world.rank == smoke.fail_rank:
        raise RuntimeError(f"injected failure (smoke.fail_rank={smoke.fail_rank})")
    start = time.monotonic()
    received = heartbeats(world, smoke.num_rounds)
    checksum = tensor_broadcast(world, config)
    world.barrier()
    tensor_note = f", tensor checksum {checksum:.6g}" if checksum is not None else ""
    log.info(
        f"{world.role} rank {world.rank} ok: {received} heartbeats from "
        f"{world.plan.world_size - 1} peers{tensor_note} in {time.monotonic() - start:.2f}s"
    )
