"""Megatron's training machinery around one model shard: DDP, optimizer, clipping, pipeline schedule.

`wrap(gpt, cfg)` returns the model in Megatron's `DistributedDataParallel` (contiguous fp32 gradient
buffers, bucketed and, with `overlap_grad_reduce`, overlapped with backward) and its optimizer from
`get_megatron_optimizer` (Adam, the distributed optimizer when asked: Adam states sharded over the
data-parallel ranks; gradient clipping by the global norm over all shards). The model config is wired so
that `get_forward_backward_func()` finalises gradients after the last micro-batch: DP reduction,
tied-embedding reduction between the first and last pipeline stage. The model runs with
`calculate_per_token_loss`, under which DDP *sums* over data-parallel ranks and the schedule never
divides a micro-batch's loss by the micro-batch count; the trainer's loss function divides by the step's
global action-token count itself and reports a token count of 0, so Megatron adds no second division.

With `precision` "bf16" the bf16 model sits in Megatron's `Float16Module` inside DDP (gradients still
accumulate and reduce in fp32) and the optimizer is Megatron's mixed-precision one (`OptimizerConfig.bf16`):
fp32 main parameters, fp32 main gradients and fp32 Adam states, the bf16 parameters copied from the main
ones after each step.

Without a learning-rate scheduler Megatron leaves weight decay on norms and biases (their group's
`wd_mult` is 0 but only the scheduler applies it); `set_hyperparameters` writes the effective values.
"""

from __future__ import annotations

from typing import Any

import torch

from rollart_hpc.train.config import TrainerConfig


def wrap(gpt: Any, cfg: TrainerConfig) -> tuple[Any, Any]:
    """(DDP-wrapped model, Megatron optimizer) for one model shard; the model config is wired for the
    pipeline schedule (`finalize_model_grads`, no-sync and loss-scale hooks)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        use_distributed_optimizer=cfg.distributed_optimizer,
        bucket_size=cfg.ddp_bucket_elements,
    )
    bf16 = cfg.precision == "bf16"
    model = DistributedDataParallel(gpt.config, ddp_cfg, _float16_module(gpt) if bf16 else gpt)
    o = cfg.optim
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        adam_eps=o.eps,
        clip_grad=o.grad_clip,
        fp16=False,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_cfg, [model])
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = model.no_sync
    gpt.config.grad_scale_func = optimizer.scale_loss
    set_hyperparameters(optimizer, cfg)
    return model, optimizer


def _float16_module(gpt: Any) -> Any:
    """`gpt` (bf16 parameters, `config.bf16`) in Megatron's `Float16Module`: floating inputs of the first
    stage are cast to bf16; the last stage's output stays bf16 when called with `fp32_output=False`."""
    from megatron.core.transformer.module import Float16Module

    return Float16Module(gpt.config, gpt)


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers inside a (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch Adam instances that hold the parameter groups and states."""
    return [o.optimizer for o in inner_optimizers(optimizer)]


def set_hyperparameters(optimizer: Any, cfg: TrainerConfig, lr: float | None = None) -> None:
    """Write lr, betas, eps and the effective weight decay (times the group's `wd_mult`) into every group."""
    o = cfg.optim
    for group in optimizer.param_groups:
        group.update(
            lr=o.lr if lr is None else lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay * group.get("wd_mult", 1.0),
        )


def reset_states(optimizer: Any) -> None:
    """Forget Adam's moments and step counts."""
    for inner in torch_optimizers(optimizer):
        inner.state.clear()


def step(optimizer: Any) -> float:
    """Clip and apply the finalised gradients; return the global gradient norm before clipping."""
    _, grad_norm, _ = optimizer.step()
    if grad_norm is None:
        grad_norm = optimizer.get_grad_norm()
    return float(grad_norm)
