"""Trainer settings: frozen, torch-free dataclasses validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollart_hpc.config.derive import derive
from rollart_hpc.config.learning import (
    ATTENTION_IMPLS,
    LOSS_IMPLS,
    PRECISIONS,
    RECOMPUTE_MODES,
    TrainingConfig,
    check_trainer_fields,
)

__all__ = [
    "ATTENTION_IMPLS",
    "LOSS_IMPLS",
    "OPTIM_FROM_SECTION",
    "PRECISIONS",
    "RECOMPUTE_MODES",
    "TRAINER_FROM_SECTION",
    "OptimConfig",
    "TrainerConfig",
]


@dataclass(frozen=True)
class OptimConfig:
    """Adam settings of Megatron's optimizer (torch AdamW underneath; decoupled weight decay).

    weight_decay applies to matrices only (dim >= 2); norm weights and biases are never decayed.
    grad_clip: Megatron's clipping rescales the step's gradient to this global L2 norm when larger; 0 off.
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.eps <= 0:
            raise ValueError(f"lr and eps must be > 0, got {self.lr}, {self.eps}")
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas must be two values in [0, 1), got {self.betas}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(
                f"weight_decay and grad_clip must be >= 0, got {self.weight_decay}, {self.grad_clip}"
            )


@dataclass(frozen=True)
class TrainerConfig:
    """micro_batch_tokens: padded tokens (rows x longest row) per forward/backward pass.
    precision: "fp32", or "bf16" (Megatron bf16 training: bf16 parameters and compute, fp32 main
    parameters, main gradients and Adam states in the optimizer; CPU and CUDA).
    seed: Megatron's RNG tracker seed. collective_timeout_s: bound on every collective and barrier.
    ppo_epochs, num_minibatches: PPO updates of an RL step (epochs over the batch x minibatches per
    epoch; `Trainer.rl_step`); 1 and 1 = one optimizer step per batch.
    tensor_parallel, pipeline_parallel: Megatron's model-parallel layout; the trainer ranks divided by
    their product form the data-parallel replicas; sequence_parallel shards the activations outside the
    tensor-parallel matmuls along the sequence (TP > 1). loss_impl: "fused" (log-probs from the last hidden
    states and the LM head, never [tokens, vocab] logits) or "eager" (the model's cross-entropy).
    distributed_optimizer: shard Adam states over data-parallel ranks; overlap_grad_reduce: reduce
    gradient buckets during backward; ddp_bucket_elements: DDP bucket size (None: Megatron's default).
    temperature: the rollout engines' sampling temperature T; the RL log-probs (`Trainer.rl_step`, its
    proximal log-probs, `Trainer.logprobs`) are log softmax(logits / T), the warm start's are at T = 1.
    attention: the layers' core attention, "sdpa" (`attention.SdpaAttention`) or "unfused" (Megatron's
    DotProductAttention); recompute: activation recomputation, "none", "selective" (core attention) or
    "full" (every layer) (`model.recompute_args`).
    """

    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch_tokens: int = 4096
    precision: str = "fp32"
    seed: int = 0
    temperature: float = 1.0
    collective_timeout_s: float = 600.0
    ppo_epochs: int = 1
    num_minibatches: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False
    loss_impl: str = "fused"
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    ddp_bucket_elements: int | None = None
    attention: str = "sdpa"
    recompute: str = "none"

    def __post_init__(self) -> None:
        check_trainer_fields(self, "trainer")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")

    @classmethod
    def from_config(
        cls, section: TrainingConfig, *, lr: float, seed: int, timeout_s: float, temperature: float = 1.0
    ) -> TrainerConfig:
        """The trainer settings of a run's [trainer] section (`TRAINER_FROM_SECTION`), at learning rate
        `lr` (the warm start's or the RL phase's), with the run's seed, the world's peer timeout bounding
        every collective and the rollout's sampling `temperature` (rollout.temperature) for the RL
        log-probs."""
        return TRAINER_FROM_SECTION(
            section,
            optim=OPTIM_FROM_SECTION(section, lr=lr),
            seed=seed,
            collective_timeout_s=timeout_s,
            temperature=temperature,
        )


OPTIM_FROM_SECTION = derive(OptimConfig, TrainingConfig, given=("lr",), kept=("betas", "eps"))
"""Adam settings: weight_decay and grad_clip of the [trainer] section; lr by phase (sft_lr, then lr)."""
TRAINER_FROM_SECTION = derive(
    TrainerConfig,
    TrainingConfig,
    given=("optim", "seed", "temperature", "collective_timeout_s"),
    kept=("ddp_bucket_elements",),
)
"""Every other trainer setting is the [trainer] section's field of the same name."""
