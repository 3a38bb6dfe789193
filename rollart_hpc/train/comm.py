"""Bounded collectives over the default process group, which holds exactly the trainer ranks.

Every collective is issued with `async_op=True` and waited on with a timeout; a timeout becomes a
`PeerTimeoutError` that names this rank, the operation and the peers that did not answer in time.
"""

from __future__ import annotations

import datetime as dt

import torch
import torch.distributed as dist

from rollart_hpc.contracts.errors import PeerTimeoutError


def _wait(work: dist.Work, what: str, timeout_s: float) -> None:
    try:
        work.wait(timeout=dt.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        me, world = dist.get_rank(), dist.get_world_size()
        peers = [r for r in range(world) if r != me]
        raise PeerTimeoutError(
            f"trainer rank {me}: {what} did not complete within {timeout_s:g}s; peers: trainer ranks {peers} ({exc})"
        ) from None


def all_reduce_sum(tensor: torch.Tensor, what: str, timeout_s: float) -> torch.Tensor:
    """In-place SUM over all trainer ranks; returns `tensor`."""
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
    assert work is not None
    _wait(work, what, timeout_s)
    return tensor


def barrier(what: str, timeout_s: float, device: torch.device) -> None:
    """All trainer ranks reach this point, or PeerTimeoutError."""
    all_reduce_sum(torch.zeros(1, device=device), f"barrier ({what})", timeout_s)


def rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()
