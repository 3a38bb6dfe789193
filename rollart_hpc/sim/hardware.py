"""Cost profiles from datasheets and a model's shape, for projecting past the calibration machine.

A `HardwareProfile` (GPUs from `plan.gpus.GPU_SPECS`, a model shape from its config.json, a layout and the
efficiency factors below) turns into the same costs a measured `sim.profile.Profile` holds, so the
discrete-event model runs unchanged. Assumptions:
- Prefill is compute-bound: a token costs 2 x params FLOP (matmuls; attention's score FLOP are ignored, a few
  percent at the contexts used) on an engine's tp GPUs at `prefill_mfu` of their bf16 peak.
- Decode is bandwidth-bound: a step reads the weights once (shared by the batch) and each running request's
  KV cache (its mean context x KV bytes per token), at `decode_mbu` of the HBM bandwidth; each request also
  costs its 2 x params FLOP at `decode_mfu` (this dominates only on compute-poor GPUs at large batch).
  Tensor parallelism divides both by tp and adds two all-reduces of the hidden state per layer per step over
  NVLink, latency-bound: `tp_allreduce_s` each.
- The trainer: (6 + 2 x `extra_forwards`) x params FLOP per token (forward and backward, plus the
  recomputed old log-probs) at `train_mfu` of the trainer GPUs' peak; the pipeline bubble (pp - 1) /
  (microbatches + pp - 1); TP all-reduces of activations over NVLink (4 per layer: 2 forward, 2 backward)
  and the data-parallel gradient reduce-scatter + all-gather (bf16) over the scale-out network, not
  overlapped with compute (a pessimistic bound).
- Weight publication: the rollout side sees the exposed part of the pull, `exposed_pull` x bytes /
  `pull_bytes_per_s` (RollArt's Table 4 pattern: push and most of the pull overlap the next rollout).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.models.config import ModelConfig, config_from_dict
from rollart_hpc.plan.gpus import GpuSpec, gpu_spec
from rollart_hpc.plan.memory import kv_bytes_per_token, model_params
from rollart_hpc.sim.model import PoolModel, Scenario
from rollart_hpc.sim.profile import EpisodeShape, Profile
from rollart_hpc.sim.workload import mean_context

BF16 = 2  # bytes


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peaks that the software reaches; every default from a public measurement."""

    # FlashAttention-2 (arXiv 2307.08691) reaches 50-73% of A100 peak in forward; a serving engine's prefill
    # with scheduling and sampling around it: the low end.
    prefill_mfu: float = 0.5
    # Databricks, "LLM Inference Performance Engineering: Best Practices" (2023): memory-bandwidth utilisation
    # of 55-60% for 7B decode on A100/H100 at small batch.
    decode_mbu: float = 0.6
    # Decode matmuls at batch <= a few hundred run far from peak; same Databricks post (MFU under 40%).
    decode_mfu: float = 0.35
    # Megatron-LM (arXiv 2104.04473): 44-52% of A100 peak for GPT-3-class models; RL batches of variable length
    # and packing losses: the low end.
    train_mfu: float = 0.44
    # NCCL all-reduce of a few KB over NVLink is latency-bound: ~10 us (nccl-tests on DGX H100, small sizes).
    tp_allreduce_s: float = 10e-6
    # RollArt Table 4, Qwen3-8B: 15.26 GB pulled in 6.2 s accumulated (2.46 GB/s per engine), of which 1.4 s
    # exposed (23%).
    pull_bytes_per_s: float = 15.26e9 / 6.2
    exposed_pull: float = 1.4 / 6.2
    # Scale-out links carry 80% of their line rate in NCCL collectives (nccl-tests bus bandwidth on NDR IB).
    network_efficiency: float = 0.8
    extra_forwards: int = 1


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of an architecture."""

    params: float
    layers: int
    hidden: int
    kv_bytes_per_token: float

    @property
    def weight_bytes(self) -> float:
        return self.params * BF16

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelShape:
        """The memory plan's counts (`plan.memory`): the HF model's parameters, bf16 KV bytes per token."""
        return cls(
            params=float(model_params(cfg)),
            layers=cfg.num_layers,
            hidden=cfg.hidden_size,
            kv_bytes_per_token=float(kv_bytes_per_token(cfg, BF16)),
        )


def read_model(path: str | Path) -> ModelShape:
    """The shape in a config.json (the file, or the directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise UsageError(f"--model: {path}: no config.json")
    try:
        raw = json.loads(p.read_text())
        return ModelShape.from_config(config_from_dict(raw))
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--model: {p}: not a model config ({exc})") from None


@dataclass(frozen=True)
class EngineCost:
    """One rollout engine's step costs, seconds (the terms of `sim.model.EngineModel`)."""

    decode_s: float
    decode_s_per_request: float
    prefill_s_per_token: float


def engine_cost(gpu: GpuSpec, model: ModelShape, tp: int, context: float, eff: Efficiency) -> EngineCost:
    """An engine of `tp` GPUs whose running requests hold `context` tokens on average (module docstring)."""
    bandwidth = tp * gpu.hbm_bytes_per_s * eff.decode_mbu
    comm = 2 * model.layers * eff.tp_allreduce_s if tp > 1 else 0.0
    return EngineCost(
        decode_s=model.weight_bytes / bandwidth + comm,
        decode_s_per_request=context * model.kv_bytes_per_token / bandwidth
        + 2 * model.params / (tp * gpu.bf16_flops * eff.decode_mfu),
        prefill_s_per_token=2 * model.params / (tp * gpu.bf16_flops * eff.prefill_mfu),
    )


@dataclass(frozen=True)
class TrainerLayout:
    gpus: int
    tp: int = 1
    pp: int = 1
    microbatches: int = 8

    @property
    def dp(self) -> int:
        return max(self.gpus // (self.tp * self.pp), 1)


def trainer_step_s(
    gpu: GpuSpec, model: ModelShape, layout: TrainerLayout, eff: Efficiency
) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of one optimizer step (module docstring)."""
    flop_per_token = (6 + 2 * eff.extra_forwards) * model.params
    bubble = (layout.pp - 1) / (layout.microbatches + layout.pp - 1)
    per_token = flop_per_token / (layout.gpus * gpu.bf16_flops * eff.train_mfu) / (1 - bubble)
    if layout.tp > 1:  # 4 all-reduces of the token's hidden state per layer, ring over tp GPUs
        ring = 2 * (layout.tp - 1) / layout.tp
        per_token += (
            4 * model.layers * model.hidden * BF16 * ring / gpu.nvlink_bytes_per_s / layout.dp / layout.pp
        )
    fixed = 0.0
    if layout.dp > 1:  # gradient reduce-scatter + parameter all-gather of this rank's shard
        shard = model.weight_bytes / (layout.tp * layout.pp)
        ring = 2 * (layout.dp - 1) / layout.dp
        fixed = 2 * shard * ring / (gpu.network_bytes_per_s * eff.network_efficiency)
    return fixed, per_token


def swap_s(model: ModelShape, eff: Efficiency) -> float:
    """The rollout-side exposed time of loading a new version."""
    return eff.exposed_pull * model.weight_bytes / eff.pull_bytes_per_s


@dataclass(frozen=True)
class GpuPool:
    """A rollout pool: `gpus` GPUs of one type in engines of `tp`, serving `families` (empty: all)."""

    name: str
    gpu: GpuSpec
    gpus: int
    tp: int = 1
    families: tuple[str, ...] = ()
    max_slots: int = 256  # the engine's max_num_seqs; the KV cache may allow fewer

    @property
    def engines(self) -> int:
        return self.gpus // self.tp


# vLLM's default gpu_memory_utilization (0.9): the share of GPU memory for weights and KV cache.
GPU_MEMORY_SHARE = 0.9


@dataclass(frozen=True)
class HardwareProfile:
    """Rollout pools, a trainer, a model and the efficiencies: the costs a measured profile would hold."""

    model: ModelShape
    pools: tuple[GpuPool, ...]
    trainer_gpu: GpuSpec
    trainer: TrainerLayout
    efficiency: Efficiency = field(default_factory=Efficiency)
    extra_swap_s: float = 0.0  # e.g. a colocated engine's offload/reload around training

    def slots(self, pool: GpuPool, episodes: tuple[EpisodeShape, ...]) -> int:
        """Requests an engine can hold: its KV cache over the mean final context, capped by max_slots."""
        free = pool.tp * pool.gpu.memory_gb * 1e9 * GPU_MEMORY_SHARE - self.model.weight_bytes
        full = max(sum(e.tokens for e in episodes) / max(len(episodes), 1), 1.0)
        fits = int(free / (full * self.model.kv_bytes_per_token))
        if fits < 1:
            raise UsageError(f"pool {pool.name}: the model does not fit on {pool.tp} x {pool.gpu.name}")
        return min(fits, pool.max_slots)

    def pool_models(self, episodes: tuple[EpisodeShape, ...]) -> tuple[PoolModel, ...]:
        out = []
        for pool in self.pools:
            if pool.engines < 1:
                continue
            cost = engine_cost(
                pool.gpu, self.model, pool.tp, mean_context(episodes, pool.families), self.efficiency
            )
            out.append(
                PoolModel(
                    pool.name,
                    pool.engines,
                    self.slots(pool, episodes),
                    cost.decode_s,
                    cost.decode_s_per_request,
                    cost.prefill_s_per_token,
                    pool.families,
                )  # fmt: skip
            )
        if not out:
            raise UsageError("no rollout engine: every pool has fewer GPUs than its tensor parallelism")
        return tuple(out)

    def profile(self, episodes: tuple[EpisodeShape, ...]) -> Profile:
        fixed, per_token = trainer_step_s(self.trainer_gpu, self.model, self.trainer, self.efficiency)
        return Profile(
            episodes=episodes,
            decode_s=0.0,
            decode_s_per_request=0.0,
            prefill_s_per_token=0.0,
            train_s=fixed,
            train_s_per_token=per_token,
            swap_s=(swap_s(self.model, self.efficiency) + self.extra_swap_s,),
            checkpoint_s=(0.0,),
        )

    def scenario(
        self, config: Config, episodes: tuple[EpisodeShape, ...], **kwargs: Any
    ) -> tuple[Scenario, Profile]:
        """The simulator's inputs: `config` paces the controller, this profile sets every cost."""
        pools = self.pool_models(episodes)
        return Scenario(config, pools=pools, **kwargs), self.profile(episodes)


def parse_hardware(text: str) -> list[tuple[GpuSpec, int]]:
    """`h800` or `h800:64,h20:24` -> [(spec, count)]; a count defaults to 0 (the caller's choice)."""
    out = []
    for item in text.split(","):
        name, _, count = item.strip().partition(":")
        if not name:
            raise UsageError(f"--hardware: empty GPU name in {text!r}; e.g. h800:64,h20:24")
        try:
            n = int(count) if count else 0
        except ValueError:
            raise UsageError(f"--hardware: {item!r}: the count after ':' must be an integer") from None
        if n < 0:
            raise UsageError(f"--hardware: {item!r}: the count must be >= 0")
        try:
            out.append((gpu_spec(name), n))
        except UsageError as exc:
            raise UsageError(f"--hardware: {exc}") from None
    return out
