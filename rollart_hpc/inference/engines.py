"""The engine registry keyed by `rollout.engine`: explicit, one constructor per engine, heavy imports lazy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rollart_hpc.config.schema import RolloutConfig
from rollart_hpc.inference.api import Engine

EngineBuilder = Callable[[RolloutConfig, Path, int, int], Engine]


def build_builtin(rollout: RolloutConfig, model_dir: Path, version: int, seed: int) -> Engine:
    """The built-in torch engine (`rollart_hpc.inference.engine.LLMEngine`)."""
    from rollart_hpc.inference.engine import LLMEngine

    return LLMEngine.from_pretrained(
        model_dir,
        num_slots=rollout.num_slots,
        max_model_len=rollout.max_model_len,
        version=version,
        seed=seed,
        batch_invariant=rollout.batch_invariant,
        prefix_cache_slots=0 if rollout.batch_invariant else rollout.prefix_cache_slots,
    )


def build_vllm(rollout: RolloutConfig, model_dir: Path, version: int, seed: int) -> Engine:
    """The vLLM adapter (`rollart_hpc.inference.vllm_engine.VLLMEngine`); imports vllm."""
    from rollart_hpc.inference.vllm_engine import VLLMEngine

    return VLLMEngine(
        model_dir,
        num_slots=rollout.num_slots,
        max_model_len=rollout.max_model_len,
        version=version,
        seed=seed,
        tensor_parallel_size=rollout.tensor_parallel_size,
    )


ENGINES: dict[str, EngineBuilder] = {"builtin": build_builtin, "vllm": build_vllm}


def build_engine(rollout: RolloutConfig, model_dir: Path, version: int, seed: int) -> Engine:
    """The engine named by `rollout.engine`, loaded from `model_dir` as policy `version`.

    `seed` is the engine's sampling seed (the rank loop passes `run.seed + world rank`).
    """
    return ENGINES[rollout.engine](rollout, model_dir, version, seed)
