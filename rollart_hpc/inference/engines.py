"""The engine registry keyed by `rollout.engine`: explicit, one constructor per engine, heavy imports lazy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rollart_hpc.config.learning import TrainingConfig
from rollart_hpc.config.schema import RolloutConfig
from rollart_hpc.inference.api import Engine

# (rollout section, trainer section: the precision and bucket size of the published weights, model dir,
# policy version, sampling seed) -> engine
EngineBuilder = Callable[[RolloutConfig, TrainingConfig, Path, int, int], Engine]
TRAINING_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # trainer.precision -> the published dtype


def engine_dtype(rollout: RolloutConfig, precision: str) -> str:
    """The dtype ("float32" or "bfloat16") an engine holds its weights and computes in: the dtype the
    trainer publishes (`trainer.precision`), or for vLLM `rollout.vllm.dtype` unless 'auto'."""
    if rollout.engine == "vllm" and rollout.vllm.dtype != "auto":
        return rollout.vllm.dtype
    return TRAINING_DTYPES[precision]


def build_builtin(
    rollout: RolloutConfig, trainer: TrainingConfig, model_dir: Path, version: int, seed: int
) -> Engine:
    """The built-in torch engine (`rollart_hpc.inference.engine.LLMEngine`) in the published dtype."""
    import torch

    from rollart_hpc.inference.engine import LLMEngine

    return LLMEngine.from_pretrained(
        model_dir,
        dtype=getattr(torch, engine_dtype(rollout, trainer.precision)),
        num_slots=rollout.num_slots,
        max_model_len=rollout.max_model_len,
        version=version,
        seed=seed,
        batch_invariant=rollout.batch_invariant,
        prefix_cache_slots=0 if rollout.batch_invariant else rollout.prefix_cache_slots,
    )


def build_vllm(
    rollout: RolloutConfig, trainer: TrainingConfig, model_dir: Path, version: int, seed: int
) -> Engine:
    """The vLLM adapter (`rollart_hpc.inference.vllm_engine.VLLMEngine`); imports vllm."""
    from rollart_hpc.inference.vllm_engine import VLLMEngine, VLLMSettings

    return VLLMEngine(model_dir, VLLMSettings.from_config(rollout, trainer), version=version, seed=seed)


ENGINES: dict[str, EngineBuilder] = {"builtin": build_builtin, "vllm": build_vllm}


def build_engine(
    rollout: RolloutConfig, trainer: TrainingConfig, model_dir: Path, version: int, seed: int
) -> Engine:
    """The engine named by `rollout.engine`, loaded from `model_dir` as policy `version`.

    `trainer` is the run's [trainer] section (what the published weights look like: their dtype,
    `engine_dtype`, and bucket size); `seed` is the engine's sampling seed (the rank loop passes
    `run.seed + world rank`).
    """
    return ENGINES[rollout.engine](rollout, trainer, model_dir, version, seed)
