"""Megatron-core GPTModel (local layer spec) built from an HF Llama/Qwen2 directory, one (TP, PP) shard.

Preconditions: torch.distributed is initialised with the trainer ranks as the default group;
`ensure_model_parallel()` builds Megatron's tensor, pipeline and data-parallel groups over it (order
tp-dp-pp: tensor-parallel ranks are adjacent, pipeline stages the slowest dimension) with the trainer's
collective timeout, and seeds its RNG tracker. Parameters are in the training precision (`param_dtype`:
fp32, or bf16 with Megatron's `bf16` config, whose fp32 main copies live in the optimizer). Every
parameter is overwritten by the converted checkpoint, split for this rank's tensor-parallel shard and
pipeline stage, so no random init is run.

The layers' core attention is torch SDPA (`attention.SdpaAttention`) or Megatron's unfused local attention;
activation recomputation ('selective' core attention, 'full' layers) is Megatron's (`recompute_args`).

`HiddenGPT` is GPTModel with one switch, `return_hidden`: the last stage then returns the final hidden
states [s, b, H] (after the final norm) instead of logits, for the fused LM-head loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollart_hpc.models.checkpoint import CheckpointReader
from rollart_hpc.models.config import ModelConfig, load_config
from rollart_hpc.train.convert import (
    check_tensor_parallel,
    hf_to_megatron,
    megatron_args,
    read_stage,
    stage_layers,
    to_stage,
)
from rollart_hpc.train.megatron_compat import allow_sequence_parallel_norms, apply_cpu_patches


@dataclass(frozen=True)
class Layout:
    """This rank's place in the trainer's (TP, PP, DP) grid, read from Megatron's parallel state."""

    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def ensure_model_parallel(
    seed: int, tensor_parallel: int = 1, pipeline_parallel: int = 1, timeout_s: float = 600.0
) -> Layout:
    """Initialise Megatron's parallel state once per process (an existing one must have the same sizes),
    seed its RNG tracker, and return this rank's layout."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as tp_lib

    apply_cpu_patches()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
            order="tp-cp-ep-dp-pp",
        )
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
    if have != (tensor_parallel, pipeline_parallel):
        raise RuntimeError(
            f"model parallel state is already initialised with (TP, PP) = {have}; "
            f"the trainer needs {(tensor_parallel, pipeline_parallel)}"
        )
    tp_lib.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def _hidden_gpt_class() -> type:
    from megatron.core.models.gpt import GPTModel

    class HiddenGPT(GPTModel):  # type: ignore[misc]
        return_hidden = False

        def _postprocess(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.return_hidden:
                return hidden_states
            return super()._postprocess(hidden_states, *args, **kwargs)

    return HiddenGPT


def param_dtype(precision: str) -> torch.dtype:
    """The parameter (and pipeline-communication) dtype of a training precision ("fp32" or "bf16")."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if precision not in dtypes:
        raise ValueError(f"precision must be one of {tuple(dtypes)}, got {precision!r}")
    return dtypes[precision]


def recompute_args(recompute: str) -> dict[str, Any]:
    """TransformerConfig settings of an activation recomputation mode: 'none'; 'selective' (the core
    attention of every layer, recomputed in backward); 'full' (every layer, one layer per checkpoint)."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")


def build_gpt(
    cfg: ModelConfig,
    device: torch.device,
    layout: Layout | None = None,
    sequence_parallel: bool = False,
    precision: str = "fp32",
    attention: str = "sdpa",
    recompute: str = "none",
) -> Any:
    """An uninitialised GPTModel for `cfg` on `device` with parameters in `precision` ("fp32", or "bf16":
    Megatron's bf16 config): this rank's shard and stage of `layout` (activations sharded along the
    sequence outside the TP matmuls with `sequence_parallel`), with core attention `attention`
    (`attention.local_layer_spec`) and activation recomputation `recompute`."""
    from megatron.core.transformer import TransformerConfig

    from rollart_hpc.train.attention import local_layer_spec

    layout = layout or Layout(1, 0, 1, 0, 1, 0)
    check_tensor_parallel(cfg, layout.tp_size)
    stage_layers(cfg.num_layers, layout.pp_rank, layout.pp_size)  # checks that PP divides the layers
    args = megatron_args(cfg, layout.tp_size)
    if sequence_parallel:
        allow_sequence_parallel_norms()
    dtype = param_dtype(precision)
    config = TransformerConfig(
        sequence_parallel=sequence_parallel,
        **args.transformer,
        pipeline_model_parallel_size=layout.pp_size,
        pipeline_dtype=dtype,
        variable_seq_lengths=layout.pp_size > 1,
        moe_token_dispatcher_type="alltoall",  # the only dispatcher Megatron allows with variable lengths
        calculate_per_token_loss=True,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **recompute_args(recompute),
    )
    model = _hidden_gpt_class()(
        config,
        local_layer_spec(attention, qk_layernorm=cfg.qk_norm),
        pre_process=layout.first_stage,
        post_process=layout.last_stage,
        **args.gpt,
    )
    _mark_tensor_parallel(model)
    return model.to(device)


def _mark_tensor_parallel(model: Any) -> None:
    """Tag the split weights as tensor-parallel. Megatron tags them only while initialising them
    (`perform_initialization`), and its gradient norm counts an untagged weight on TP rank 0 only."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or getattr(weight, "tensor_model_parallel", False):
            continue
        dims = {ColumnParallelLinear: 0, VocabParallelEmbedding: 0, RowParallelLinear: 1}
        dim = next((d for kind, d in dims.items() if isinstance(module, kind)), None)
        if dim is not None:
            weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, dim, 1


def load_megatron_weights(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Copy a stage's local-spec state dict into `model`; every parameter must be covered."""
    result = model.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"weights do not match the model: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


def shard_weights(hf: dict[str, torch.Tensor], cfg: ModelConfig, layout: Layout) -> dict[str, torch.Tensor]:
    """Full HF weights held in memory -> the Megatron state dict of this rank's tensor shard and pipeline
    stage (`read_shard` reads the same from a directory without holding the full weights)."""
    full = hf_to_megatron(hf, cfg, layout.tp_rank, layout.tp_size)
    layers = stage_layers(cfg.num_layers, layout.pp_rank, layout.pp_size)
    return to_stage(full, layers, layout.first_stage, layout.last_stage, cfg.tie_word_embeddings)


def read_shard(model_dir: str | Path, cfg: ModelConfig, layout: Layout) -> dict[str, torch.Tensor]:
    """The Megatron state dict of this rank's tensor shard and pipeline stage, read from the HF directory
    (single file or sharded) tensor by tensor: only the stage's tensors and this rank's slices of the
    split ones reach host memory (`convert.read_stage`), never a full copy of the weights."""
    with CheckpointReader(model_dir, cfg) as reader:
        return read_stage(reader, cfg, layout.tp_rank, layout.tp_size, layout.pp_rank, layout.pp_size)


def gpt_from_hf(
    model_dir: str | Path, device: torch.device, layout: Layout | None = None, *options: Any, **named: Any
) -> tuple[Any, ModelConfig]:
    """Build this rank's GPTModel shard of an HF directory (`build_gpt`, which takes the further `options`
    and `named` ones: sequence_parallel, precision, attention, recompute) and load its weights (cast to the
    parameter dtype), reading only this rank's shard of the checkpoint (`read_shard`); return (model,
    config)."""
    layout = layout or Layout(1, 0, 1, 0, 1, 0)
    cfg = load_config(model_dir)
    model = build_gpt(cfg, device, layout, *options, **named)
    load_megatron_weights(model, read_shard(model_dir, cfg, layout))
    return model, cfg
