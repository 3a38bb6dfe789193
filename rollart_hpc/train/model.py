"""Megatron-core GPTModel (local layer spec) built from an HF Llama/Qwen2 directory, weights converted in.

Preconditions: torch.distributed is initialised; `ensure_model_parallel()` sets up Megatron's parallel
state with tensor parallel size 1 (the data-parallel group is then the whole default group) and seeds
its RNG tracker. Parameters are fp32 (master weights); a bf16 compute dtype is applied by the caller with
autocast on GPU. Every parameter is overwritten by the converted checkpoint, so no random init is run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rollart_hpc.models.checkpoint import load_weights
from rollart_hpc.models.config import ModelConfig, load_config
from rollart_hpc.train.convert import hf_to_megatron, megatron_args
from rollart_hpc.train.megatron_compat import apply_cpu_patches


def ensure_model_parallel(seed: int) -> None:
    """Initialise Megatron's parallel state (TP=1, PP=1) once per process and seed its RNG tracker."""
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_patches()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size != 1:
        raise RuntimeError(
            f"model parallel state is already initialised with TP={tp_size}; the trainer needs 1"
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt(cfg: ModelConfig, device: torch.device) -> Any:
    """An uninitialised fp32 GPTModel for `cfg` on `device`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    args = megatron_args(cfg)
    config = TransformerConfig(
        **args.transformer,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,
        params_dtype=torch.float32,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(), **args.gpt)
    return model.to(device)


def load_megatron_weights(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Copy a full local-spec state dict into `model`; every parameter must be covered."""
    result = model.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"weights do not match the model: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


def gpt_from_hf(model_dir: str | Path, device: torch.device) -> tuple[Any, ModelConfig]:
    """Build the GPTModel of an HF directory and load its converted weights; return (model, config)."""
    cfg = load_config(model_dir)
    model = build_gpt(cfg, device)
    load_megatron_weights(model, hf_to_megatron(load_weights(model_dir, cfg), cfg))
    return model, cfg
