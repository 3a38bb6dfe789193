"""A standalone torch.distributed process group for weight sync, built from an MPI-exchanged TCPStore.

In a run the default torch.distributed group holds only the trainer ranks (Megatron needs that), so the
group that carries weights from the publishing trainer to the rollout ranks is built by hand:

1. every member sends its node name to the first member over MPI (timed `World.send/recv`);
2. the first member starts a `TCPStore` server on a free port (port 0: the OS picks it, no race) on an
   address every member can reach, and sends (host, port) back to each member over MPI;
3. every member connects a `TCPStore` client and builds `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL`
   (GPU) with its member index; construction completes once all members have joined (timed).

Who waits on whom: every collective is issued with its async work and waited with a deadline. A member
that waits for the source names the source; the source names the members that never arrived for this
round (each member records its latest round in the store before it enters that round's broadcasts), or,
when all arrived, every member (the transfer stalled). After a `PeerTimeoutError` the group is broken:
close it and build a new one. Every member must create its groups in the same order.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from rollart_hpc.cluster.torchdist import rendezvous_store
from rollart_hpc.cluster.world import World
from rollart_hpc.contracts.errors import PeerTimeoutError, UsageError
from rollart_hpc.contracts.protocol import Tag

Backend = Literal["gloo", "nccl"]


@dataclass
class StandaloneGroup:
    """A process group over `member_ranks` (world ranks, in member order) with timed broadcasts."""

    world: World
    member_ranks: list[int]
    backend: Backend
    timeout_s: float
    pg: Any
    store: Any
    member: int = field(init=False)

    def __post_init__(self) -> None:
        self.member = self.member_ranks.index(self.world.rank)

    @property
    def size(self) -> int:
        return len(self.member_ranks)

    def describe_member(self, member: int) -> str:
        return self.world.plan.describe(self.member_ranks[member])

    def broadcast(self, tensor: torch.Tensor, src_member: int, what: str = "broadcast") -> None:
        """Broadcast `tensor` from member `src_member` to all members, bounded by the timeout."""
        self.wait(self.start_broadcast(tensor, src_member), src_member, what)

    def start_broadcast(self, tensor: torch.Tensor, src_member: int) -> Any:
        """Issue an asynchronous broadcast; returns the work to pass to `wait`."""
        return self.pg.broadcast(tensor, src_member)

    def wait(self, work: Any, src_member: int, what: str, round_id: int | None = None) -> None:
        """Wait for `work` within the timeout; on timeout raise `PeerTimeoutError` naming the peers."""
        try:
            work.wait(dt.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise PeerTimeoutError(self._timeout_message(src_member, what, round_id, exc)) from None

    def mark_arrival(self, round_id: int) -> None:
        """Record in the store that this member entered round `round_id` (used to name silent peers)."""
        self.store.set(f"arrived/{self.member}", str(round_id))

    def missing_members(self, round_id: int) -> list[int]:
        """Members (other than this one) whose latest recorded round is older than `round_id`."""
        missing = []
        for member in range(self.size):
            key = f"arrived/{member}"
            if member == self.member:
                continue
            if not self.store.check([key]) or int(self.store.get(key)) < round_id:
                missing.append(member)
        return missing

    def _timeout_message(self, src_member: int, what: str, round_id: int | None, exc: Exception) -> str:
        head = f"{self.world.me}: {what} did not complete within {self.timeout_s:g}s"
        if src_member != self.member:
            return f"{head}; source {self.describe_member(src_member)} did not deliver ({exc})"
        others = [m for m in range(self.size) if m != self.member]
        missing = self.missing_members(round_id) if round_id is not None else []
        if missing:
            names = ", ".join(self.describe_member(m) for m in missing)
            return f"{head}; never joined: {names} ({exc})"
        names = ", ".join(self.describe_member(m) for m in others)
        return f"{head}; stalled peers among: {names} ({exc})"

    def close(self) -> None:
        """Shut the backend down (best effort is not silent: shutdown errors propagate)."""
        if self.pg is not None:
            self.pg.shutdown()
            self.pg = None


def make_standalone_group(
    world: World, member_ranks: list[int], backend: Backend, timeout_s: float
) -> StandaloneGroup:
    """Collective over `member_ranks`: build the group; every member calls it with the same arguments."""
    if world.rank not in member_ranks:
        raise ValueError(f"{world.me} is not a member of the group {member_ranks}")
    if len(set(member_ranks)) != len(member_ranks):
        raise ValueError(f"duplicate ranks in group members {member_ranks}")
    timeout = dt.timedelta(seconds=timeout_s)
    store = rendezvous_store(world, member_ranks, Tag.WEIGHTS_GROUP, timeout)
    member = member_ranks.index(world.rank)
    try:
        pg = _make_backend(backend, store, member, len(member_ranks), timeout)
    except RuntimeError as exc:
        peers = ", ".join(world.plan.describe(r) for r in member_ranks if r != world.rank)
        raise PeerTimeoutError(
            f"{world.me}: weight group did not form within {timeout_s:g}s; peers: {peers} ({exc})"
        ) from exc
    return StandaloneGroup(world, list(member_ranks), backend, timeout_s, pg, store)


def _make_backend(backend: Backend, store: Any, member: int, size: int, timeout: dt.timedelta) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, member, size, timeout)
    if backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not torch.cuda.is_available():
            raise UsageError("weight group backend 'nccl' needs a CUDA build of torch and a visible GPU")
        options = nccl.Options()
        options._timeout = timeout
        return nccl(store, member, size, options)
    raise UsageError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
