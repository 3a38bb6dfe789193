"""The memory plan of a resolved config: every rank of its run plan with the bytes it holds on its GPU.

`memory_plan(config)` reads the model's shapes (`model_shapes`: the tiny model the run would build, the
published SmolLM2-135M-Instruct config, or the config.json of `model.path`; nothing else of the model
directory is needed), lays the run plan's ranks out (trainer ranks in Megatron's tp-dp-pp order: TP rank
fastest, pipeline stage slowest) and sums the terms of `plan.memory` per rank. A rank whose GPU memory is
unknown (`roles.<role>.gpu_memory_gb` 0 and no known `gpu_type`) is reported and never refused;
controller, env and reward ranks are host-only. `MemoryPlan.refusal()` is the one line naming the first
rank that cannot fit, its total, its limit and its biggest term. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart_hpc.cluster.plan import RoleRange, RunPlan, make_plan
from rollart_hpc.config.learning import TrainingConfig
from rollart_hpc.config.schema import Config, PolicyModelConfig, RolloutConfig
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.models.config import ModelConfig, config_from_dict, load_config
from rollart_hpc.plan.gpus import GB, gpu_memory_bytes
from rollart_hpc.plan.memory import (
    CUDA_CONTEXT_BYTES,
    DTYPE_BYTES,
    Activations,
    LayerShape,
    StageLayout,
    activation_terms,
    kv_bytes_per_token,
    largest_tensor_params,
    model_params,
    publication_bytes,
    receive_bytes,
    stage_params,
    state_terms,
)

# SmolLM2-135M-Instruct's published config.json (model.source = 'smollm2').
SMOLLM2_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
BUILTIN_ENGINE_BYTES = 4  # the built-in engine runs in float32 (its default dtype)


@dataclass(frozen=True)
class RankMemory:
    """One rank: bytes on its (busiest) GPU by term, its GPU's memory (None: unknown or no GPU), bytes it
    writes per checkpoint, notes, and a reason it cannot run besides its total (e.g. vLLM's share)."""

    rank: int
    role: str
    label: str
    terms: dict[str, int] = field(default_factory=dict)
    limit: int | None = None
    checkpoint: int = 0
    notes: tuple[str, ...] = ()
    problem: str = ""

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    @property
    def biggest(self) -> tuple[str, int]:
        return max(self.terms.items(), key=lambda kv: kv[1]) if self.terms else ("", 0)

    @property
    def fits(self) -> bool:
        return not self.problem and (self.limit is None or self.total <= self.limit)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "role": self.role,
            "label": self.label,
            "total_bytes": self.total,
            "limit_bytes": self.limit,
            "fits": self.fits,
            "biggest": self.biggest[0],
            "terms": self.terms,
            "checkpoint_bytes": self.checkpoint,
            "notes": list(self.notes),
            "problem": self.problem,
        }


@dataclass(frozen=True)
class MemoryPlan:
    model: ModelConfig
    ranks: tuple[RankMemory, ...]

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    def refusal(self) -> str | None:
        """One line naming the first rank that cannot fit (None when every rank fits)."""
        for r in self.ranks:
            if r.fits:
                continue
            name, size = r.biggest
            limit = "an unknown" if r.limit is None else f"{gb(r.limit)} GB"
            why = f"; {r.problem}" if r.problem else ""
            return (
                f"memory plan: {r.label} needs {gb(r.total)} GB of {limit} GPU memory; biggest term "
                f"{name} {gb(size)} GB{why}"
            )
        return None

    def check(self) -> None:
        """UsageError with `refusal()` when some rank cannot fit."""
        line = self.refusal()
        if line is not None:
            raise UsageError(line)

    def table(self) -> str:
        m = self.model
        lines = [
            f"memory plan (GB = 1e9 bytes, per GPU): {m.model_type}, {model_params(m) / 1e6:,.1f}M parameters, "
            f"{m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}",
            f"  {'rank':>4}  {'role':<30} {'total':>8} {'limit':>8}  fit  terms",
        ]
        for r in self.ranks:
            limit = "-" if r.limit is None else gb(r.limit)
            fit = "yes" if r.fits else "NO"
            terms = ", ".join(f"{k} {gb(v)}" for k, v in r.terms.items())
            lines.append(f"  {r.rank:>4}  {r.label:<30} {gb(r.total):>8} {limit:>8}  {fit:<3}  {terms}")
            lines.extend(f"{'':>8}{note}" for note in (*r.notes, r.problem) if note)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        m = self.model
        return {
            "model": {
                "model_type": m.model_type,
                "parameters": model_params(m),
                "num_layers": m.num_layers,
                "hidden_size": m.hidden_size,
                "vocab_size": m.vocab_size,
            },
            "fits": self.fits,
            "refusal": self.refusal(),
            "ranks": [r.to_dict() for r in self.ranks],
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def gb(size: float) -> str:
    return f"{size / GB:.2f}"


def model_shapes(model: PolicyModelConfig, max_model_len: int) -> ModelConfig:
    """The policy model's architecture as the run would build or load it (UsageError without one)."""
    if model.source == "smollm2":
        return config_from_dict(SMOLLM2_CONFIG)
    if model.source == "tiny":
        return config_from_dict(
            {
                "model_type": model.family,
                "vocab_size": model.vocab_size,
                "hidden_size": model.hidden_size,
                "intermediate_size": 4 * model.hidden_size,
                "num_hidden_layers": model.num_layers,
                "num_attention_heads": model.num_heads,
                "num_key_value_heads": model.num_kv_heads,
                "head_dim": model.head_dim,
                "max_position_embeddings": max(2048, max_model_len),
                "tie_word_embeddings": True,
            }
        )
    try:
        return load_config(model.path)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(f"model.path: no model shapes for the memory plan: {exc}") from exc


def memory_plan(config: Config) -> MemoryPlan:
    """The memory plan of every rank of `config`'s run plan."""
    cfg = model_shapes(config.model, config.rollout.max_model_len)
    plan = make_plan(config.roles)
    ranks: list[RankMemory] = []
    for part in plan.roles:
        if part.role == "trainer":
            ranks += trainer_ranks(plan, part, cfg, config.trainer, config.rollout.max_model_len)
        elif part.role == "rollout":
            ranks += rollout_ranks(plan, part, cfg, config.rollout, config.trainer)
        else:
            ranks += [host_rank(plan, rank, part) for rank in part.ranks]
    return MemoryPlan(cfg, tuple(ranks))


def memory_plan_text(config: Config) -> tuple[str, str | None]:
    """(the memory plan's table, its refusal line or None); a plan without model shapes (a model
    directory only the cluster sees) is one line saying so, and refuses nothing."""
    try:
        memory = memory_plan(config)
    except UsageError as exc:
        return f"memory plan not computed: {exc}", None
    return memory.table(), memory.refusal()


def host_rank(plan: RunPlan, rank: int, part: RoleRange) -> RankMemory:
    asked = f", {part.resources.mem_gb}G requested" if part.resources.mem_gb else ""
    return RankMemory(rank, part.role, label(plan, rank), notes=(f"host only{asked}",))


def label(plan: RunPlan, rank: int) -> str:
    """'trainer rank 9 (trainer #0)', the run plan's name of a rank."""
    return plan.describe(rank)


def trainer_ranks(
    plan: RunPlan, part: RoleRange, cfg: ModelConfig, t: TrainingConfig, max_model_len: int
) -> list[RankMemory]:
    """Every trainer rank, in Megatron's tp-dp-pp order; the first one publishes the weights."""
    tp, model_parallel = t.tensor_parallel, t.tensor_parallel * t.pipeline_parallel
    dp = max(1, part.num_ranks // model_parallel)
    publish_bytes = model_params(cfg) * DTYPE_BYTES[t.precision]
    act = trainer_activations(t, max_model_len)
    out = []
    for i, rank in enumerate(part.ranks):
        lay = StageLayout(tp, t.pipeline_parallel, dp, i // (tp * dp))
        params = stage_params(cfg, lay)
        terms = state_terms(params, t.precision, dp, t.distributed_optimizer)
        terms |= activation_terms(cfg, act, lay, LayerShape.of(cfg), t.loss_impl)
        if i == 0:
            bucket = int(t.bucket_mb * 2**20)
            terms["publication"] = publication_bytes(cfg, DTYPE_BYTES[t.precision], bucket, model_parallel)
        if model_parallel > 1 and (i // tp) % dp == 0:
            terms["weight_gather"] = publish_bytes // cfg.num_layers
        if part.resources.gpus_per_rank:
            terms["cuda_context"] = CUDA_CONTEXT_BYTES
        checkpoint = sum(v for k, v in terms.items() if k in ("params", "main_params", "adam"))
        note = (
            f"tp {i % tp} pp {lay.stage} dp {(i // tp) % dp}: {params / 1e6:,.1f}M parameters; "
            f"checkpoint shard (model + optimizer) {gb(checkpoint)} GB"
        )
        limit = gpu_memory_bytes(part.resources)
        out.append(RankMemory(rank, "trainer", label(plan, rank), terms, limit, checkpoint, (note,)))
    return out


def trainer_activations(t: TrainingConfig, max_model_len: int) -> Activations:
    """A trainer's micro-batch: micro_batch_tokens in rows of at most max_model_len tokens (a longer
    sequence is a micro-batch alone), in the training precision."""
    return Activations(
        tokens=max(t.micro_batch_tokens, max_model_len),
        row_len=max_model_len,
        dtype_bytes=DTYPE_BYTES[t.precision],
        sequence_parallel=t.sequence_parallel,
        recompute=t.recompute,
        attention=t.attention,
    )


def rollout_ranks(
    plan: RunPlan, part: RoleRange, cfg: ModelConfig, r: RolloutConfig, t: TrainingConfig
) -> list[RankMemory]:
    receive = receive_bytes(cfg, DTYPE_BYTES[t.precision], int(t.bucket_mb * 2**20))
    slots = getattr(part.resources, "num_slots", 0) or r.num_slots
    limit = gpu_memory_bytes(part.resources)
    if r.engine == "vllm":
        rows = [vllm_rank(cfg, r, t, limit, receive, slots) for _ in part.ranks]
    else:
        rows = [builtin_rank(cfg, r, limit, receive, slots) for _ in part.ranks]
    return [
        RankMemory(rank, "rollout", label(plan, rank), terms, limit, notes=notes, problem=problem)
        for rank, (terms, notes, problem) in zip(part.ranks, rows, strict=True)
    ]


RankTerms = tuple[dict[str, int], tuple[str, ...], str]


def vllm_rank(
    cfg: ModelConfig, r: RolloutConfig, t: TrainingConfig, limit: int | None, receive: int, slots: int
) -> RankTerms:
    """vLLM's share of the GPU (weights and KV cache inside it) plus the weight update outside it."""
    dtype = t.precision if r.vllm.dtype == "auto" else r.vllm.dtype
    tp = r.tensor_parallel_size
    weights = model_params(cfg) * DTYPE_BYTES[dtype] // tp
    # A weight update is staged one chunk of at most trainer.bucket_mb at a time; a larger tensor goes alone.
    largest = largest_tensor_params(cfg) * DTYPE_BYTES[t.precision]
    outside = {
        "receive_buffers": receive,
        "vllm_staging": max(int(t.bucket_mb * 2**20), largest),
        "cuda_context": CUDA_CONTEXT_BYTES,
    }
    if limit is None:
        return {"vllm_weights": weights, **outside}, ("vLLM's share of an unknown GPU: weights only",), ""
    share = int(r.vllm.gpu_memory_utilization * limit)
    room = share - weights
    sequence = r.max_model_len * kv_bytes_per_token(cfg, DTYPE_BYTES[dtype], tp)
    notes = (
        f"vLLM share {gb(share)} GB ({r.vllm.gpu_memory_utilization} x GPU): weights {gb(weights)} GB, KV-cache "
        f"room {gb(max(room, 0))} GB = {max(room, 0) // sequence} sequences of {r.max_model_len} tokens "
        f"(num_slots {slots}; vLLM's activation peak comes out of it)",
    )
    problem = ""
    if room < sequence:
        problem = (
            f"vLLM's share {gb(share)} GB leaves {gb(room)} GB beside weights {gb(weights)} GB, less than "
            f"one sequence's KV cache ({gb(sequence)} GB)"
        )
    return {"vllm": share, **outside}, notes, problem


def builtin_rank(
    cfg: ModelConfig, r: RolloutConfig, limit: int | None, receive: int, slots: int
) -> RankTerms:
    """The built-in engine: weights, a staged copy of them, the KV cache rows, the receive buckets."""
    weights = model_params(cfg) * BUILTIN_ENGINE_BYTES
    rows = slots + r.prefix_cache_slots
    kv = rows * r.max_model_len * kv_bytes_per_token(cfg, BUILTIN_ENGINE_BYTES)
    terms = {"weights": weights, "staged_weights": weights, "kv_cache": kv, "receive_buffers": receive}
    notes = (f"KV cache: {rows} rows x {r.max_model_len} positions" + ("" if limit else "; on the host"),)
    return terms, notes, ""
