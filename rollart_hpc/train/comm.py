"""Bounded collectives over the trainer ranks: the default process group, or one of Megatron's groups.

Every collective is issued with `async_op=True` and waited on with a timeout; a timeout becomes a
`PeerTimeoutError` that names this rank, the operation and the peers that did not answer in time.
Megatron's own collectives (DDP buckets, distributed optimizer, pipeline p2p) are bounded by the timeout
its groups were created with (`model.ensure_model_parallel`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import torch
import torch.distributed as dist

from rollart_hpc.contracts.errors import PeerTimeoutError


def _wait(work: dist.Work, what: str, timeout_s: float, group: Any = None) -> None:
    try:
        work.wait(timeout=dt.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        me = dist.get_rank()
        members = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        peers = [r for r in members if r != me]
        raise PeerTimeoutError(
            f"trainer rank {me}: {what} did not complete within {timeout_s:g}s; peers: trainer ranks {peers} ({exc})"
        ) from None


def all_reduce_sum(tensor: torch.Tensor, what: str, timeout_s: float, group: Any = None) -> torch.Tensor:
    """In-place SUM over all trainer ranks (or `group`); returns `tensor`."""
    return all_reduce(tensor, what, timeout_s, dist.ReduceOp.SUM, group)


def all_reduce(
    tensor: torch.Tensor, what: str, timeout_s: float, op: Any = dist.ReduceOp.SUM, group: Any = None
) -> torch.Tensor:
    """In-place reduction `op` over all trainer ranks (or `group`); returns `tensor`."""
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    assert work is not None
    _wait(work, what, timeout_s, group)
    return tensor


def broadcast(tensor: torch.Tensor, src: int, what: str, timeout_s: float, group: Any = None) -> torch.Tensor:
    """In-place broadcast from global rank `src` over `group`; returns `tensor`."""
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    assert work is not None
    _wait(work, what, timeout_s, group)
    return tensor


def barrier(what: str, timeout_s: float, device: torch.device) -> None:
    """All trainer ranks reach this point, or PeerTimeoutError."""
    all_reduce_sum(torch.zeros(1, device=device), f"barrier ({what})", timeout_s)


def rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()
