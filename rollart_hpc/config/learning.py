"""The learning sections of the config: [algo] (the SPO++ experiments' arms, the tracker, the sampler, the
PPO clips) and [trainer] (how the trainer role trains: optimiser, warm start, PPO epochs, parallel layout,
loss implementation). Torch-free; `rollart_hpc.config.schema.Config` holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from rollart_hpc.config.choices import (
    ALGO_DEFAULTS,
    ALGO_PRESETS,
    CLIP_DEFAULTS,
    DEFAULT_CLIP,
    DEFAULT_GROUP_SIZE,
    LEGACY_ADVANTAGE,
    AlgoName,
    Estimator,
    GroupAdvantage,
    Level,
    LossAgg,
    Normalization,
    TrackerKind,
)
from rollart_hpc.config.loader import check_bounds, doc_field
from rollart_hpc.contracts.errors import UsageError


@dataclass(frozen=True)
class AlgoConfig:
    """The [algo] section. `name` picks an arm of the SPO++ experiments and fills the arm's fields
    (`ALGO_PRESETS`); a field set to another value than the preset's is a UsageError ('custom' combines
    freely). Resolved once at construction: the resolved file holds the filled fields."""

    name: AlgoName = doc_field(
        "spo++",
        "Algorithm arm: 'spo++' (event_time tracker, action_token normalisation), 'spo' (arrival tracker, "
        "trajectory whitening), 'grpo' / 'dr_grpo' / 'rloo' (group estimator; dr_grpo with the constant "
        "seq_mean_token_sum_norm aggregation), 'reinforce++' (batch estimator, token_mean), 'gspo' (GRPO "
        "advantages, sequence-level ratio clipped to 3e-4 / 4e-4, seq_mean_token_mean), 'custom' (set the "
        "fields below).",
    )
    tracker: TrackerKind = doc_field(
        "",
        "Value tracker: 'event_time' (SPO++ Eq. 3: evidence weighs rho^(policy events since it was "
        "generated)); 'arrival' (SPO: evidence folded in arrival order, rho from policy drift, see "
        "arrival_drift_per_version). '' = set by algo.name. The group estimator uses it for task sampling only.",
    )
    normalization: Normalization = doc_field(
        "",
        "Advantage normalisation of the tracker estimator over a batch: 'action_token' (SPO++ Eq. 6) or "
        "'trajectory' (SPO Eq. 4 whitening). '' = set by algo.name (none with the group estimator).",
    )
    estimator: Estimator = doc_field(
        "",
        "'tracker': A = R - the tracker's baseline frozen at dispatch; 'group': group_size episodes of one "
        "task are dispatched back to back and centred on their group (group_advantage); 'batch' "
        "(REINFORCE++): A = (R - batch mean) / (batch std + 1e-8) over the step's trajectories (unbiased "
        "std; no critic, no group). '' = set by algo.name.",
    )
    group_size: int = doc_field(
        0,
        f"Group estimator: episodes per group (>= 2; must divide controller.batch_size; 0 = "
        f"{DEFAULT_GROUP_SIZE}). A batch holds whole groups; a group with fewer than 2 successful episodes "
        "is dropped (cause group_incomplete).",
    )
    group_advantage: GroupAdvantage = doc_field(
        "",
        "Group estimator: 'grpo' ((R - mean_G) / std_G), 'dr_grpo' (R - mean_G) or 'rloo' (leave-one-out: "
        "R_i - mean_{j != i} R_j = G / (G - 1) (R_i - mean_G)). '' = set by algo.name.",
    )
    advantage: Literal["", "spo++", "spo"] = doc_field(
        "",
        "Deprecated spelling of normalization: 'spo++' = 'action_token', 'spo' = 'trajectory' (no other effect).",
    )
    rho: float = doc_field(0.875, "Event-time tracker: retention per policy event.")
    arrival_drift_per_version: float = doc_field(
        0.006,
        "Arrival tracker: the drift D of SPO's rho = clamp(2^(-D/0.06), rho_min, rho_max) is this times the "
        "policy versions published since the task's previous result was folded (the controller has no "
        "current-policy log-probs to measure D; the version gap is its proxy). First visit: D = 0.",
    )
    arrival_rho_min: float = doc_field(0.875, "Arrival tracker: smallest rho.")
    arrival_rho_max: float = doc_field(0.96, "Arrival tracker: largest rho (that of D = 0).")
    sampler_epsilon: float = doc_field(0.05, "Task sampler: w = sqrt(v(1-v)) + epsilon.")
    max_in_flight_per_task: int = doc_field(
        1, "Task sampler: concurrent requests (groups, with the group estimator) per task."
    )
    sampler_balance: Literal["task", "family"] = doc_field(
        "task",
        "Task sampler: 'task' = every training task by its priority weight (a family's share of the "
        "dispatches follows its task count and values); 'family' = an env family uniformly among those "
        "with a task below its cap, then one of its tasks by priority weight (each family an equal share).",
    )
    clip_low: float = doc_field(
        0.0, "Ratio clip below 1 (0 = the arm's default: 0.2; gspo 3e-4, clipping the sequence ratio)."
    )
    clip_high: float = doc_field(0.0, "Ratio clip above 1 (0 = the arm's default: 0.28; gspo 4e-4).")
    dual_clip_c: float = doc_field(2.0, "Negative dual-clip constant c (> 1; 0 = off).")
    is_cap: float = doc_field(
        2.0, "Cap on the behaviour importance weight exp(old - behaviour), at is_level (0 = unbounded)."
    )
    decoupled: bool = doc_field(
        False,
        "Decoupled PPO (AReaL): drop tokens whose behaviour weight exceeds is_cap instead of truncating.",
    )
    is_level: Level = doc_field(
        "token",
        "Behaviour weight per 'token' (exp(old_t - behaviour_t)) or per 'sequence' (exp of the mean over the "
        "trajectory's action tokens of (old - behaviour), on all its tokens).",
    )
    is_reject_low: float = doc_field(
        0.0,
        "Mask out tokens (is_level 'token') or trajectories ('sequence') whose behaviour weight lies below "
        "this (in (0, 1); 0 = no lower bound). They stay in the loss's denominator.",
    )
    is_reject_high: float = doc_field(
        0.0,
        "Mask out tokens or trajectories whose behaviour weight lies above this (> 1; 0 = no upper bound).",
    )
    ratio_level: Level = doc_field(
        "",
        "PPO ratio per 'token' or per 'sequence' (GSPO: s_i = exp(mean over the trajectory's action tokens "
        "of (logp - old)), clipped at the sequence level). '' = set by algo.name ('token').",
    )
    loss_agg: LossAgg = doc_field(
        "",
        "Aggregation of the per-token loss: 'token_mean' (divided by the step's action-token count), "
        "'seq_mean_token_mean' (each trajectory's token mean, averaged over the step's trajectories), "
        "'seq_mean_token_sum_norm' (each trajectory's token sum divided by loss_agg_tokens, averaged over "
        "the trajectories: Dr. GRPO's constant batch size x loss_agg_tokens). '' = set by algo.name.",
    )
    loss_agg_tokens: int = doc_field(
        0,
        "seq_mean_token_sum_norm: the constant per-trajectory token count C of the denominator (the longest "
        "response; 0 = rollout.max_model_len, which no trajectory exceeds).",
    )
    entropy_coef: float = doc_field(
        0.0,
        "Entropy bonus: the loss subtracts this x the action-token entropy of the policy, aggregated as "
        "the loss (0 = off; the entropy is logged either way).",
    )
    kl_coef: float = doc_field(
        0.0,
        "KL to a reference policy, a frozen copy of the warm-start weights on the trainer ranks (0 = off; "
        "> 0 also logs kl, the token mean of the estimate).",
    )
    kl_estimator: Literal["", "k1", "k2", "k3"] = doc_field(
        "",
        "Per-token estimator of KL(policy || reference), log r = ref - logp: 'k1' = -log r, 'k2' = (log r)^2 "
        "/ 2, 'k3' = r - 1 - log r. '' = 'k3' when kl_coef > 0.",
    )
    kl_in: Literal["", "loss", "reward"] = doc_field(
        "",
        "'loss': kl_coef x the estimate joins the per-token loss (aggregated as the loss); 'reward': each "
        "action token's advantage loses kl_coef x the estimate summed from it to its trajectory's end "
        "(the proximal policy's, no gradient). '' = 'loss' when kl_coef > 0.",
    )

    def __post_init__(self) -> None:
        if self.advantage:
            meant = LEGACY_ADVANTAGE[self.advantage]
            if self.normalization not in ("", meant):
                raise UsageError(
                    f"algo.advantage: {self.advantage!r} means normalization {meant!r}, "
                    f"but algo.normalization is {self.normalization!r}; remove algo.advantage"
                )
            object.__setattr__(self, "normalization", meant)
        for key, want in ALGO_PRESETS[self.name].items():
            have = getattr(self, key)
            if have not in ("", want):
                field = "advantage" if key == "normalization" and self.advantage else key
                raise UsageError(
                    f"algo.{field}: {getattr(self, field)!r} conflicts with algo.name = {self.name!r} (which "
                    f"sets {key} {want!r}); use algo.name = 'custom' to combine arms"
                )
            object.__setattr__(self, key, want)
        for key, want in ALGO_DEFAULTS.items():
            if not getattr(self, key):
                object.__setattr__(self, key, want)
        if self.estimator == "tracker" and not self.normalization:
            object.__setattr__(self, "normalization", "action_token")
        if self.estimator == "group":
            object.__setattr__(self, "group_advantage", self.group_advantage or "grpo")
            object.__setattr__(self, "group_size", self.group_size or DEFAULT_GROUP_SIZE)
        clip = CLIP_DEFAULTS.get(self.name, DEFAULT_CLIP)
        object.__setattr__(self, "clip_low", self.clip_low or clip[0])
        object.__setattr__(self, "clip_high", self.clip_high or clip[1])
        if self.kl_coef:
            object.__setattr__(self, "kl_estimator", self.kl_estimator or "k3")
            object.__setattr__(self, "kl_in", self.kl_in or "loss")

    def validate(self, path: str) -> None:
        self._validate_estimator(path)
        self._validate_loss(path)
        if not 0.0 < self.rho <= 1.0:
            raise UsageError(f"{path}.rho: must lie in (0, 1], got {self.rho}")
        arrival = ("arrival_drift_per_version", "arrival_rho_min", "arrival_rho_max")
        if self.tracker != "arrival":
            for key in arrival:
                if getattr(self, key) != getattr(AlgoConfig, key):
                    raise UsageError(f"{path}.{key}: only the arrival tracker uses it; remove it")
        elif self.rho != AlgoConfig.rho:
            raise UsageError(f"{path}.rho: the arrival tracker adapts rho (arrival_*); remove it")
        check_bounds(self, path, arrival_drift_per_version=">= 0")
        if not 0.0 < self.arrival_rho_min <= self.arrival_rho_max <= 1.0:
            raise UsageError(f"{path}: 0 < arrival_rho_min <= arrival_rho_max <= 1 required")
        if self.max_in_flight_per_task < 1 or self.sampler_epsilon <= 0:
            raise UsageError(f"{path}: max_in_flight_per_task >= 1 and sampler_epsilon > 0 required")

    def _validate_estimator(self, path: str) -> None:
        if self.estimator == "group":
            if self.group_size < 2:
                raise UsageError(f"{path}.group_size: the group estimator needs >= 2, got {self.group_size}")
            if self.normalization:
                raise UsageError(
                    f"{path}.normalization: has no effect with {path}.estimator = 'group'; remove it"
                )
        else:
            for key in ("group_size", "group_advantage"):
                if getattr(self, key):
                    raise UsageError(f"{path}.{key}: only the group estimator uses it; remove it")
        if self.estimator == "batch" and self.normalization:
            raise UsageError(
                f"{path}.normalization: has no effect with {path}.estimator = 'batch'; remove it"
            )

    def _validate_loss(self, path: str) -> None:
        """One-line errors for loss settings out of range, contradicting each other or without effect."""
        if not (0 < self.clip_low < 1 and self.clip_high > 0):
            raise UsageError(f"{path}.clip_low, {path}.clip_high: need 0 < clip_low < 1 and clip_high > 0")
        if self.dual_clip_c < 0 or 0 < self.dual_clip_c <= 1:
            raise UsageError(f"{path}.dual_clip_c: must be > 1 (or 0 = off), got {self.dual_clip_c}")
        if self.is_cap < 0:
            raise UsageError(f"{path}.is_cap: must be > 0 (or 0 = off), got {self.is_cap}")
        if self.decoupled and not self.is_cap:
            raise UsageError(
                f"{path}.decoupled: drops tokens whose weight exceeds {path}.is_cap; set is_cap > 0"
            )
        if not (self.is_reject_low == 0 or 0 < self.is_reject_low < 1):
            raise UsageError(
                f"{path}.is_reject_low: must lie in (0, 1) (or 0 = off), got {self.is_reject_low}"
            )
        if not (self.is_reject_high == 0 or self.is_reject_high > 1):
            raise UsageError(f"{path}.is_reject_high: must be > 1 (or 0 = off), got {self.is_reject_high}")
        if self.is_reject_high and self.decoupled:
            raise UsageError(
                f"{path}.is_reject_high: {path}.decoupled already drops weights above is_cap; set one"
            )
        if self.is_reject_high and self.is_cap >= self.is_reject_high:
            raise UsageError(
                f"{path}.is_cap: {self.is_cap} >= {path}.is_reject_high never truncates; remove it"
            )
        if self.loss_agg_tokens < 0 or (self.loss_agg_tokens and self.loss_agg != "seq_mean_token_sum_norm"):
            raise UsageError(
                f"{path}.loss_agg_tokens: only loss_agg = 'seq_mean_token_sum_norm' uses it (> 0)"
            )
        check_bounds(self, path, entropy_coef=">= 0", kl_coef=">= 0")
        for key in ("kl_estimator", "kl_in"):
            if getattr(self, key) and not self.kl_coef:
                raise UsageError(f"{path}.{key}: has no effect with {path}.kl_coef = 0; remove it")


Precision = Literal["fp32", "bf16"]
LossImpl = Literal["fused", "eager"]
AttentionImpl = Literal["sdpa", "unfused"]
RecomputeMode = Literal["none", "selective", "full"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
LOSS_IMPLS: tuple[str, ...] = get_args(LossImpl)
ATTENTION_IMPLS: tuple[str, ...] = get_args(AttentionImpl)
RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)


def check_trainer_fields(settings: Any, path: str) -> None:
    """The rules on the fields the [trainer] section shares with the trainer's own settings
    (`rollart_hpc.train.config.TrainerConfig`, derived from the section by name): checked by both, stated
    once. `path` names the section in the one-line `UsageError`."""
    counts = ("micro_batch_tokens", "ppo_epochs", "num_minibatches", "tensor_parallel", "pipeline_parallel")
    check_bounds(settings, path, **dict.fromkeys(counts, ">= 1"))
    if settings.sequence_parallel and settings.tensor_parallel == 1:
        raise UsageError(f"{path}.sequence_parallel: needs {path}.tensor_parallel > 1")
    for key, allowed in (
        ("precision", PRECISIONS),
        ("loss_impl", LOSS_IMPLS),
        ("attention", ATTENTION_IMPLS),
        ("recompute", RECOMPUTE_MODES),
    ):
        if getattr(settings, key) not in allowed:
            raise UsageError(f"{path}.{key}: {getattr(settings, key)!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class TrainingConfig:
    """The [trainer] section: how the trainer role trains (`rollart_hpc.train.config.TrainerConfig` is
    derived from it by field name)."""

    lr: float = doc_field(1e-3, "AdamW learning rate of the RL phase.")
    weight_decay: float = doc_field(0.0, "AdamW weight decay.")
    grad_clip: float = doc_field(1.0, "Gradient norm clip (0 = off).")
    micro_batch_tokens: int = doc_field(4096, "Tokens per micro-batch on one trainer rank.")
    sft_steps: int = doc_field(20, "Supervised warm-start steps on oracle demonstrations before RL.")
    sft_lr: float = doc_field(3e-3, "Learning rate of the warm start.")
    sft_batch_size: int = doc_field(16, "Demonstrations per warm-start step.")
    sft_sampling: Literal["task", "family"] = doc_field(
        "task",
        "How the warm start draws each demonstration: 'task' = a training task uniformly (a family's share "
        "is its share of the tasks); 'family' = a family uniformly, then one of its tasks uniformly (every "
        "family gets an equal share of the warm start whatever its task count).",
    )
    rl_fresh_optimizer: bool = doc_field(
        True, "Start RL with fresh AdamW moments (the warm start's would scale the first RL steps)."
    )
    rl_lr_warmup_steps: int = doc_field(
        0,
        "RL steps over which the learning rate rises linearly to lr (step k uses lr x min(1, (k+1)/N); "
        "0 = none). Fresh AdamW moments make the first steps sign-like, each parameter moved by the full lr.",
    )
    num_threads: int = doc_field(1, "torch threads of a trainer rank.")
    bucket_mb: float = doc_field(32.0, "Weight publication bucket size, MiB.")
    bucket_direct_mb: float = doc_field(
        1.0,
        "Weights of at least this many MiB get a publication bucket of their own, landed by the built-in "
        "engine straight in its staging tensors, no receive buffer or bucket copy (0 = off: every weight "
        "packed into the shared buckets).",
    )
    ppo_epochs: int = doc_field(
        1, "PPO epochs over each RL batch (> 1: the proximal log-probs are the step's start, clipping acts)."
    )
    num_minibatches: int = doc_field(
        1, "Minibatches per PPO epoch, one optimizer step each (a trainer rank's sequences split evenly)."
    )
    tensor_parallel: int = doc_field(
        1,
        "Tensor-parallel size (Megatron); must divide the model's heads and vocabulary. Data parallel = "
        "roles.trainer.num_ranks / (tensor_parallel x pipeline_parallel).",
    )
    pipeline_parallel: int = doc_field(
        1, "Pipeline-parallel stages (Megatron 1F1B schedule); must divide the model's layers."
    )
    sequence_parallel: bool = doc_field(
        False,
        "Shard activations outside the tensor-parallel matmuls along the sequence (tensor_parallel > 1).",
    )
    loss_impl: LossImpl = doc_field(
        "fused",
        "'fused': log-probs and loss from the last hidden states and the LM-head weight, never the "
        "[tokens, vocab] logits (Triton on CUDA, chunked torch on CPU; vocabulary-parallel under TP); "
        "'eager': the model's own (vocab-parallel) cross-entropy over full logits.",
    )
    distributed_optimizer: bool = doc_field(
        True, "Shard the Adam states over the data-parallel ranks (Megatron's distributed optimizer)."
    )
    overlap_grad_reduce: bool = doc_field(True, "Reduce gradient buckets while backward runs (Megatron DDP).")
    precision: Precision = doc_field(
        "fp32",
        "Training precision: 'bf16' = bf16 parameters and compute with fp32 main parameters, gradients and "
        "Adam states in Megatron's optimizer (weights published and loaded in bf16, half the bytes); "
        "'fp32' = fp32 throughout (TF32 matmuls on CUDA).",
    )
    attention: AttentionImpl = doc_field(
        "sdpa",
        "Core attention of the trainer's layers: 'sdpa' = torch scaled_dot_product_attention (flash / "
        "memory-efficient kernels on CUDA, flash-attn's varlen kernel when installed; never [s, s] fp32 "
        "scores kept for backward on GPU); 'unfused' = Megatron's local DotProductAttention.",
    )
    recompute: RecomputeMode = doc_field(
        "none",
        "Activation recomputation (Megatron): 'selective' recomputes the core attention in backward, 'full' "
        "every transformer layer's forward (uniform, one layer per checkpoint); 'none' keeps activations.",
    )

    def validate(self, path: str) -> None:
        if self.lr <= 0 or self.sft_lr <= 0 or self.micro_batch_tokens < 64 or self.sft_steps < 0:
            raise UsageError(f"{path}: lr, sft_lr > 0, micro_batch_tokens >= 64, sft_steps >= 0 required")
        if self.bucket_mb <= 0 or self.bucket_direct_mb < 0 or 0 < self.bucket_direct_mb * 2**20 < 64:
            raise UsageError(
                f"{path}.bucket_mb must be > 0 and {path}.bucket_direct_mb 0 (off) or at least 64 bytes, "
                f"got {self.bucket_mb:g}, {self.bucket_direct_mb:g}"
            )
        check_bounds(self, path, rl_lr_warmup_steps=">= 0")
        check_trainer_fields(self, path)

    def validate_layout(self, path: str, num_ranks: int) -> None:
        """The trainer ranks must split into whole tensor x pipeline groups (the rest is data parallel)."""
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if num_ranks % model_parallel:
            raise UsageError(
                f"{path}.tensor_parallel x {path}.pipeline_parallel = {model_parallel} must divide "
                f"roles.trainer.num_ranks = {num_ranks}"
            )
