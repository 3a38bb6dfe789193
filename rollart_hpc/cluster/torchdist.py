"""torch.distributed on top of a World: process group from MPI rendezvous, role groups, timed collectives.

Every rank creates the same groups in the same order (a torch.distributed rule). Collectives run with
`async_op=True` and a bounded `wait`; a timeout becomes `PeerTimeoutError` naming the group's peers.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rollart_hpc.cluster.placement import group_backend
from rollart_hpc.cluster.world import World, rendezvous_address
from rollart_hpc.config.schema import ROLE_NAMES
from rollart_hpc.contracts.errors import PeerTimeoutError


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


def init_torch_groups(world: World, requested_backend: str) -> TorchGroups:
    """Create the default process group from an MPI rendezvous, then the role and weights groups.
    'auto' is NCCL only when every rank of the world has GPUs (`cluster.placement.group_backend`)."""
    everyone = range(world.plan.world_size)
    backend = group_backend(requested_backend, world.plan, everyone, torch.cuda.is_available())
    host, port = rendezvous_address(world)
    timeout = dt.timedelta(seconds=world.timeout_s)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=world.rank,
        world_size=world.plan.world_size,
        timeout=timeout,
    )
    by_role = {}
    for role in ROLE_NAMES:
        ranks = list(world.plan.ranks_of(role))
        by_role[role] = dist.new_group(ranks, timeout=timeout) if ranks else None
    weights_ranks = list(world.plan.ranks_of("trainer")) + list(world.plan.ranks_of("rollout"))
    weights = dist.new_group(weights_ranks, timeout=timeout)
    return TorchGroups(world, backend, by_role, weights, weights_ranks)


def destroy_torch_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
