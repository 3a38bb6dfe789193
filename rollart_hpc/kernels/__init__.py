"""Triton kernels with their torch references (installed as rollart_hpc.kernels).

`policy_loss` holds the entry points (`fused_token_terms`, `fused_policy_loss`, `linear_logprob`,
`head_logprob` for a whole or vocabulary-parallel head, the implementation selector); `lm_head_triton` the
Triton kernels and `lm_head_reference` their torch reference of the same signature; `token_loss` the
per-token SPO++ terms in torch and their one reduction to the loss and `LossDiagnostics`; `entropy` the
per-token softmax entropy with its gradient (chunked torch, also
vocabulary-parallel). This package imports nothing of `rollart_hpc` outside `rollart_hpc.kernels`.
Names below load their module on first access, so importing the package imports neither torch nor triton.
"""

from __future__ import annotations

import importlib
from typing import Any

EXPORTS = {
    "FusedTokens": "policy_loss",
    "IMPLS": "policy_loss",
    "fused_policy_loss": "policy_loss",
    "fused_token_terms": "policy_loss",
    "head_logprob": "policy_loss",
    "linear_logprob": "policy_loss",
    "resolve_impl": "policy_loss",
    "KernelLossConfig": "common",
    "KernelTuning": "common",
    "LossInputs": "common",
    "LossDiagnostics": "token_loss",
    "SUMMED_DIAGNOSTICS": "token_loss",
    "TokenTerms": "token_loss",
    "ppo_token_terms": "token_loss",
    "reduce_token_terms": "token_loss",
    "eager_policy_loss": "lm_head_reference",
    "head_entropy": "entropy",
}

__all__ = sorted(EXPORTS)


def __getattr__(name: str) -> Any:
    if name in EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
