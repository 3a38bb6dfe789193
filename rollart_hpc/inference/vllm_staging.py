"""A staging buffer shared between a rollout rank and vLLM's worker processes, for in-place weight loads.

vLLM's engine core and workers run in child processes of the rollout rank, and tensors passed as RPC
arguments are serialised element by element. So new weights travel through one flat byte buffer that
both sides map: the rollout rank packs the received tensors into it (one copy, at memory bandwidth) and
then asks every worker, by a collective RPC carrying only a small handle and the layout, to load the
named views of that buffer into its model.

- CPU: a file under /dev/shm (or the temp dir) mapped shared by both sides (`torch.from_file`).
- CUDA: one device allocation exported by CUDA IPC (`torch.multiprocessing.reductions.reduce_tensor`);
  workers open it on the same device index, which names the same GPU because vLLM's workers inherit the
  rollout rank's CUDA_VISIBLE_DEVICES.

Invariants: the layout places every tensor at an ALIGN-aligned offset of a single bucket (see
`rollart_hpc.weights.buckets`); the rollout rank writes the buffer only while no load RPC is running
(the engine serialises updates), and the workers finish reading (device synchronised) before the RPC
returns. The owner keeps the buffer alive (and the file linked) until `close()`.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rollart_hpc.weights.buckets import ALIGN, BucketLayout, pack, plan_layout, unpack

SHM_DIR = Path("/dev/shm")


def single_bucket_layout(named: Mapping[str, torch.Tensor]) -> BucketLayout:
    """A layout that places every tensor of `named`, in order, into one bucket."""
    total = sum((t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN for t in named.values())
    return plan_layout(((n, tuple(t.shape), t.dtype) for n, t in named.items()), max(total, ALIGN))


class StagingBuffer:
    """One flat uint8 buffer on `device`, shareable with child processes through `handle`."""

    def __init__(self, layout: BucketLayout, device: torch.device) -> None:
        if layout.num_buckets != 1:
            raise ValueError(f"a staging layout has one bucket, got {layout.num_buckets}")
        self.layout = layout
        self.layout_bytes = layout.to_bytes()
        self.nbytes = layout.total_nbytes
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

    def matches(self, layout: BucketLayout) -> bool:
        return layout.to_bytes() == self.layout_bytes

    def write(self, named: Mapping[str, torch.Tensor]) -> None:
        """Copy `named` (exactly the layout's tensors) into the buffer; returns once the bytes are there."""
        pack(self.layout, named, [self.buffer])
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
