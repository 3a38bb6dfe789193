"""Triton kernels with their torch references (installed as rollart_hpc.kernels).

`policy_loss` holds the entry points (`fused_policy_loss`, `linear_logprob`, the implementation selector);
`lm_head_triton` the Triton kernels and `lm_head_reference` their torch reference of the same signature.
Names below load their module on first access, so importing the package imports neither torch nor triton.
"""

from __future__ import annotations

import importlib
from typing import Any

EXPORTS = {
    "FusedDiagnostics": "policy_loss",
    "IMPLS": "policy_loss",
    "fused_policy_loss": "policy_loss",
    "linear_logprob": "policy_loss",
    "resolve_impl": "policy_loss",
    "KernelTuning": "common",
    "LossInputs": "common",
    "eager_policy_loss": "lm_head_reference",
}

__all__ = sorted(EXPORTS)


def __getattr__(name: str) -> Any:
    if name in EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
