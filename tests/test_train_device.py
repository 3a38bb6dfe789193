"""The single-rank trainer tests' device helper (tests/train_device.py): its tolerances are float32's on
the CPU and TF32's while CUDA runs fp32 matmuls in TF32 (simulated here by pointing it at a CUDA device)."""

from __future__ import annotations

import pytest
import torch
import train_device
from train_device import TF32_TOL, assert_close, exact_fp32, tol


def test_on_the_cpu_tolerances_are_float32s() -> None:
    if train_device.DEVICE.type != "cpu":
        pytest.skip("the CPU's tolerances")
    assert train_device.BACKEND == "gloo" and not train_device.tf32()
    assert tol(1e-5) == 1e-5
    want = torch.linspace(-1.0, 1.0, 11)
    assert_close(want + 5e-7, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        assert_close(want + 1e-4, want, rtol=1e-5, atol=1e-6)


def test_under_tf32_tolerances_widen_to_the_operands_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_device, "DEVICE", torch.device("cuda", 0))
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # a flag; nothing runs on CUDA here
    try:
        assert train_device.tf32() and tol(1e-5) == TF32_TOL and tol(1e-2) == 1e-2
        want = torch.linspace(-1.0, 1.0, 11)  # holds an exact 0: its error is measured against max |want|
        assert_close(want + 1e-3, want, rtol=1e-5, atol=1e-7)
        with pytest.raises(AssertionError):
            assert_close(want + 1e-2, want, rtol=1e-5, atol=1e-7)
        with exact_fp32():
            assert not train_device.tf32() and tol(1e-5) == 1e-5
        assert train_device.tf32()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
