"""The four CUDA -> CPU patches that let megatron-core 0.16.1 train on a machine without CUDA.

`apply_cpu_patches()` is the only place in the project that patches anything. It does nothing where CUDA
is available, and is idempotent (a module flag; repeated calls return at once). Call it before building a
Megatron model or calling `model_parallel_cuda_manual_seed`.

1. rng: Megatron's CUDA RNG tracker reads and writes the CPU generator instead.
2. dev: `torch.cuda.current_device()` returns "cpu" (Megatron moves RoPE tables and buffers with it).
3. factories: literal `device="cuda"` in the Megatron modules that create tensors inline (causal mask,
   token counts, optimizer scaling, grad clipping, broadcast_data) becomes "cpu"; the stand-in `torch` is
   module-scoped, so it works in every thread and costs nothing elsewhere. `Tensor.cuda()` returns the
   tensor itself; `torch.cuda.synchronize` / `empty_cache` do nothing.
4. type: `Tensor.type()` of a CPU tensor reports `torch.cuda.*Tensor`, which Megatron's clip-grad and
   distributed-optimizer asserts require.

`allow_sequence_parallel_norms()` (any device) lets the local layer spec's torch norms run under sequence
parallelism: Megatron's `WrappedTorchNorm` refuses it, although a norm acts per token; the patched
constructor builds the norm and tags its parameters `sequence_parallel`, so `finalize_model_grads` sums
their per-shard gradients over the tensor-parallel group.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

# Megatron modules with inline `device="cuda"` tensor factories (megatron.core.<name>).
FACTORY_MODULES = (
    "transformer.utils",
    "pipeline_parallel.schedules",
    "optimizer.optimizer",
    "optimizer.clip_grads",
    "utils",
    "rerun_state_machine",
    "tensor_parallel.data",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")
_applied = False
_norms_patched = False


class _CpuTorch:
    """A module-local stand-in for `torch` whose tensor factories map a CUDA device to the CPU."""

    def __init__(self) -> None:
        for name in _FACTORIES:
            self.__dict__[name] = _cpu_factory(getattr(torch, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cpu_factory(factory: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapped


def _patch_rng() -> None:
    random: Any = importlib.import_module("megatron.core.tensor_parallel.random")
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment,misc]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment,misc,return-value]
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


def _patch_factories() -> None:
    for name in FACTORY_MODULES:
        module = importlib.import_module("megatron.core." + name)
        module.torch = _CpuTorch()  # type: ignore[attr-defined]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda *args, **kwargs: None  # type: ignore[assignment]


def _patch_type() -> None:
    original = torch.Tensor.type

    def cuda_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = original(self)
            if self.device.type == "cpu" and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = cuda_type  # type: ignore[method-assign,assignment]


def apply_cpu_patches() -> bool:
    """Apply the four patches on a machine without CUDA; return whether they are in effect."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        _patch_rng()
        _patch_current_device()
        _patch_factories()
        _patch_type()
        _applied = True
    return True


def allow_sequence_parallel_norms() -> None:
    """Patch `WrappedTorchNorm` to accept sequence parallelism (idempotent); see the module docstring."""
    global _norms_patched
    if _norms_patched:
        return
    torch_norm: Any = importlib.import_module("megatron.core.transformer.torch_norm")
    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls: Any, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        sequence_parallel = config.sequence_parallel
        object.__setattr__(config, "sequence_parallel", False)
        try:
            norm = original(cls, config, hidden_size, *args, **kwargs)
        finally:
            object.__setattr__(config, "sequence_parallel", sequence_parallel)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new
    _norms_patched = True
