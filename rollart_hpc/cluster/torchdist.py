"""torch.distributed on top of a World: process group from MPI rendezvous, role groups, timed collectives.

A group's rendezvous (`rendezvous_store`): the first member starts a `TCPStore` server on port 0 (the OS
picks a free port while it binds: no window in which another process can take it), and sends its
(host, port) to the other members over MPI; they connect as clients. Every rank creates the same groups in the same order (a torch.distributed rule). Collectives run with
`async_op=True` and a bounded `wait`; a timeout becomes `PeerTimeoutError` naming the group's peers.
"""

from __future__ import annotations

import datetime as dt
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rollart_hpc.cluster.placement import group_backend
from rollart_hpc.cluster.world import World
from rollart_hpc.config.schema import ROLE_NAMES
from rollart_hpc.contracts.errors import PeerTimeoutError
from rollart_hpc.contracts.protocol import Tag


@dataclass
class TorchGroups:
    """torch.distributed groups of a run: one per role, plus `weights` (trainers + rollout ranks)."""

    world: World
    backend: str
    by_role: dict[str, Any]
    weights: Any
    weights_ranks: list[int]

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any, ranks: list[int]) -> None:
        """Broadcast from world rank `src` within `group`; bounded by the world's peer timeout."""
        work = dist.broadcast(tensor, src=src, group=group, async_op=True)
        timed_wait(work, self.world, f"broadcast from {self.world.plan.describe(src)}", ranks)

    def all_reduce(self, tensor: torch.Tensor, group: Any, ranks: list[int]) -> None:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        timed_wait(work, self.world, "all_reduce", ranks)


def timed_wait(work: Any, world: World, what: str, ranks: list[int]) -> None:
    timeout = dt.timedelta(seconds=world.timeout_s)
    try:
        work.wait(timeout=timeout)
    except RuntimeError as exc:
        peers = ", ".join(world.plan.describe(r) for r in ranks if r != world.rank)
        raise PeerTimeoutError(
            f"{world.me}: {what} did not complete within {world.timeout_s:g}s; peers: {peers} ({exc})"
        ) from None


def rendezvous_store(world: World, member_ranks: list[int], tag: Tag, timeout: dt.timedelta) -> Any:
    """Collective over `member_ranks` (MPI messages with `tag`): the `TCPStore` of a new torch group.
    The first member serves it on 127.0.0.1 when every member is on its node, else on `store_address`."""
    first = member_ranks[0]
    if world.rank != first:
        world.send(world.env.node_name, first, tag)
        host, port = world.recv(first, tag)
        return dist.TCPStore(host, port, len(member_ranks), False, timeout, wait_for_workers=False)
    nodes = [world.recv(peer, tag) for peer in member_ranks[1:]]
    same_node = all(n == world.env.node_name for n in nodes)
    host = "127.0.0.1" if same_node else store_address(world)
    server = dist.TCPStore(host, 0, len(member_ranks), True, timeout, wait_for_workers=False)
    for peer in member_ranks[1:]:
        world.send((host, int(server.port)), peer, tag)
    return server


def store_address(world: World) -> str:
    """The address other nodes reach this node's stores on: `World.store_host` (its address on the
    interface [cluster.net] names), else the address its host name resolves to."""
    return world.store_host or socket.gethostbyname(socket.gethostname())


def init_torch_groups(world: World, requested_backend: str) -> TorchGroups:
    """Create the default process group from an MPI rendezvous, then the role and weights groups.
    'auto' is NCCL only when every rank of the world has GPUs (`cluster.placement.group_backend`)."""
    everyone = range(world.plan.world_size)
    backend = group_backend(requested_backend, world.plan, everyone, torch.cuda.is_available())
    timeout = dt.timedelta(seconds=world.timeout_s)
    store = rendezvous_store(world, list(everyone), Tag.RENDEZVOUS, timeout)
    dist.init_process_group(
        backend, store=store, rank=world.rank, world_size=world.plan.world_size, timeout=timeout
    )
    by_role = {}
    for role in ROLE_NAMES:
        ranks = list(world.plan.ranks_of(role))
        by_role[role] = dist.new_group(ranks, timeout=timeout) if ranks else None
    weights_ranks = list(world.plan.ranks_of("trainer")) + list(world.plan.ranks_of("rollout"))
    weights = dist.new_group(weights_ranks, timeout=timeout)
    return TorchGroups(world, backend, by_role, weights, weights_ranks)


def destroy_torch_groups() -> None:
    """Leave every group. The store lives in the first member: it must leave after the others are done
    with the groups (e.g. `World.barrier()` first)."""
    if dist.is_initialized():
        dist.destroy_process_group()
