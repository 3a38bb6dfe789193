"""The trainer's device in a single-rank test process, and float32 tolerances that hold on it.

`DEVICE` is the device a Trainer built in this process runs on (`train.trainer.pick_device`: the current
CUDA device with TF32 matmuls on, else the CPU); tests that build models or tensors for the trainer's code
put them there, and `BACKEND` is the process group that can carry its tensors (NCCL for CUDA tensors).

TF32 (on for fp32 matmuls on CUDA) rounds the inputs of a matmul to a 10-bit mantissa: two computations of
the same value along different paths (another kernel, another micro-batch split, the CPU) then differ by up
to ~1e-3 of the operands' scale, not by fp32's ~1e-7. `tol` widens a float32 tolerance to `TF32_TOL` while
TF32 is on and leaves it as it is otherwise; `assert_close` measures elementwise errors against the
largest element of the expected tensor under TF32 (an element near 0 carries the error of its neighbours).
`exact_fp32` turns TF32 off for a block whose comparison needs fp32 itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rollart_hpc.train.trainer import pick_device

DEVICE = pick_device()
BACKEND = "nccl" if DEVICE.type == "cuda" else "gloo"
TF32_TOL = 2e-3


def tf32() -> bool:
    """Whether fp32 matmuls on DEVICE run in TF32 now."""
    return DEVICE.type == "cuda" and bool(torch.backends.cuda.matmul.allow_tf32)


def tol(fp32: float) -> float:
    """A relative tolerance of exact float32 arithmetic, widened to TF32_TOL while TF32 is on."""
    return max(fp32, TF32_TOL) if tf32() else fp32


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    """`torch.testing.assert_close` at (rtol, atol) in float32; under TF32 at TF32_TOL, relative to the
    elements and to the largest element of `want`."""
    if not tf32():
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        return
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=TF32_TOL, atol=max(atol, TF32_TOL * scale))


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """fp32 matmuls in full float32 within the block (TF32 off on CUDA; nothing to do on the CPU)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
