"""A staging buffer shared between a rollout rank and vLLM's worker processes, for in-place weight loads.

vLLM's engine core and workers run in child processes of the rollout rank, and tensors passed as RPC
arguments are serialised element by element. So new weights travel through one flat byte buffer that
both sides map: the rollout rank packs the received tensors into it (one copy, at memory bandwidth) and
then asks every worker, by a collective RPC carrying only a small handle and the layout, to load the
named views of that buffer into its model. A version moves in chunks (`chunk_layouts`: consecutive
tensors of at most one publication bucket, a larger tensor alone), packed one after the other into the
same buffer, so the buffer holds one bucket, never the whole model.

- CPU: a file under /dev/shm (or the temp dir) mapped shared by both sides (`torch.from_file`).
- CUDA: one device allocation exported by CUDA IPC (`torch.multiprocessing.reductions.reduce_tensor`);
  workers open it on the same device index, which names the same GPU because vLLM's workers inherit the
  rollout rank's CUDA_VISIBLE_DEVICES.

Invariants: a chunk's layout places every tensor at an ALIGN-aligned offset of a single bucket no larger
than the buffer (see `rollart_hpc.weights.buckets`); the rollout rank writes the buffer only while no
load RPC is running (the engine serialises updates and chunks), and the workers finish reading (device
synchronised) before the RPC returns. The owner keeps the buffer alive (and the file linked) until
`close()`.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rollart_hpc.weights.buckets import ALIGN, BucketLayout, TensorSlot, layout_for, pack, unpack

SHM_DIR = Path("/dev/shm")


def chunk_layouts(named: Sequence[tuple[str, torch.Tensor]], capacity: int) -> list[BucketLayout]:
    """`named`, in order, as single-bucket layouts of consecutive tensors, each at most `capacity` bytes
    (a tensor larger than that alone, in a bucket of its own size): the chunks of one staged update."""
    layout = layout_for(named, max(capacity, ALIGN))
    slots: list[list[TensorSlot]] = [[] for _ in range(layout.num_buckets)]
    for slot in layout.slots:
        slots[slot.bucket].append(dataclasses.replace(slot, bucket=0))
    return [BucketLayout(tuple(s), (n,)) for s, n in zip(slots, layout.bucket_nbytes, strict=True)]


class StagingBuffer:
    """One flat uint8 buffer of `nbytes` on `device`, shareable with child processes through `handle`."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = max(nbytes, ALIGN)
        self.path: Path | None = None
        if device.type == "cpu":
            self.buffer, self.handle = self._file_backed()
        elif device.type == "cuda":
            self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            self.handle = pickle.dumps(("cuda_ipc", _reduce_cuda(self.buffer)))
        else:
            raise ValueError(f"staging buffers live on cpu or cuda, not {device}")

    def _file_backed(self) -> tuple[torch.Tensor, bytes]:
        directory = SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else None
        fd, name = tempfile.mkstemp(prefix="rollart-vllm-weights-", dir=directory)
        os.close(fd)
        self.path = Path(name)
        os.truncate(self.path, self.nbytes)
        buffer = torch.from_file(name, shared=True, size=self.nbytes, dtype=torch.uint8)
        return buffer, pickle.dumps(("file", name, self.nbytes))

    def write(self, layout: BucketLayout, named: Mapping[str, torch.Tensor]) -> None:
        """Copy the tensors of the single-bucket `layout` (taken from `named`, which may hold more) into the
        buffer; returns once the bytes are there."""
        if layout.num_buckets != 1 or layout.total_nbytes > self.nbytes:
            raise ValueError(
                f"a staged chunk is one bucket of at most {self.nbytes} bytes, got {layout.bucket_nbytes}"
            )
        try:
            chunk = {slot.name: named[slot.name] for slot in layout.slots}
        except KeyError as exc:
            raise ValueError(f"tensors do not match the layout: missing {exc}") from None
        pack(layout, chunk, [self.buffer[: layout.total_nbytes]])
        if self.buffer.is_cuda:
            torch.cuda.current_stream(self.buffer.device).synchronize()

    def close(self) -> None:
        """Unlink the backing file (mappings already open stay valid until their owners drop them)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


def _reduce_cuda(buffer: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(buffer)


def open_staging(handle: bytes) -> torch.Tensor:
    """Worker side: map the buffer that `StagingBuffer.handle` describes (trusted: our own parent's)."""
    kind, *rest = pickle.loads(handle)
    if kind == "file":
        path, nbytes = rest
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    if kind == "cuda_ipc":
        rebuild, args = rest[0]
        tensor: torch.Tensor = rebuild(*args)
        return tensor
    raise ValueError(f"unknown staging handle kind {kind!r}")


def staged_tensors(buffer: torch.Tensor, layout_bytes: bytes) -> list[tuple[str, torch.Tensor]]:
    """Named typed views into a mapped staging buffer, in layout order."""
    return unpack(BucketLayout.from_bytes(layout_bytes), [buffer])
