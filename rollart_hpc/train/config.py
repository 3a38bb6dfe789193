"""Trainer settings: frozen, torch-free dataclasses validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollart_hpc.config.learning import TrainingConfig

PRECISIONS = ("fp32", "bf16")
LOSS_IMPLS = ("fused", "eager")
ATTENTION_IMPLS = ("sdpa", "unfused")
RECOMPUTE_MODES = ("none", "selective", "full")


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
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError(
                f"tensor_parallel and pipeline_parallel must be >= 1, got {self.tensor_parallel}, "
                f"{self.pipeline_parallel}"
            )
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("sequence_parallel needs tensor_parallel > 1")
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(f"loss_impl must be one of {LOSS_IMPLS}, got {self.loss_impl!r}")
        if self.attention not in ATTENTION_IMPLS or self.recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"attention must be one of {ATTENTION_IMPLS} and recompute one of {RECOMPUTE_MODES}, "
                f"got {self.attention!r}, {self.recompute!r}"
            )
        if self.ppo_epochs < 1 or self.num_minibatches < 1:
            raise ValueError(
                f"ppo_epochs and num_minibatches must be >= 1, got {self.ppo_epochs}, {self.num_minibatches}"
            )
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")

    @classmethod
    def from_config(
        cls, section: TrainingConfig, *, lr: float, seed: int, timeout_s: float, temperature: float = 1.0
    ) -> TrainerConfig:
        """The trainer settings of a run's [trainer] section, at learning rate `lr` (the warm start's or
        the RL phase's), with the run's seed, the world's peer timeout bounding every collective and the
        rollout's sampling `temperature` (rollout.temperature) for the RL log-probs."""
        optim = OptimConfig(lr=lr, weight_decay=section.weight_decay, grad_clip=section.grad_clip)
        return cls(
            optim=optim,
            micro_batch_tokens=section.micro_batch_tokens,
            seed=seed,
            temperature=temperature,
            collective_timeout_s=timeout_s,
            ppo_epochs=section.ppo_epochs,
            num_minibatches=section.num_minibatches,
            tensor_parallel=section.tensor_parallel,
            pipeline_parallel=section.pipeline_parallel,
            sequence_parallel=section.sequence_parallel,
            loss_impl=section.loss_impl,
            distributed_optimizer=section.distributed_optimizer,
            overlap_grad_reduce=section.overlap_grad_reduce,
            precision=section.precision,
            attention=section.attention,
            recompute=section.recompute,
        )
