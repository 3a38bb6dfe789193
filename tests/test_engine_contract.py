"""The engine contract (tests/engine_contract.py) for the built-in engine; the reference is a fresh one."""

from __future__ import annotations

from pathlib import Path

import engine_contract as contract
import pytest

from rollart_hpc.inference.api import Engine
from rollart_hpc.inference.engine import LLMEngine
from rollart_hpc.models.config import load_config
from rollart_hpc.models.tiny import make_tiny_model

METHODS = ("add_request", "abort", "step", "has_unfinished", "has_staged_weights", "update_weights", "close")
SMALL = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256}


def builtin(model_dir: Path, version: int) -> Engine:
    return LLMEngine.from_pretrained(
        model_dir, num_slots=4, max_model_len=256, version=version, eos_token_ids=()
    )


@pytest.fixture(
    scope="module", params=[("llama", False), ("qwen2", True)], ids=["llama-untied", "qwen2-tied"]
)
def dirs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    family, tied = request.param
    root = tmp_path_factory.mktemp(f"contract-{family}")
    return [
        make_tiny_model(
            root / str(seed), family=family, seed=seed, init_std=0.08, tie_word_embeddings=tied, **SMALL
        )
        for seed in (1, 2)
    ]


def _vocab(dirs: list[Path]) -> int:
    return load_config(dirs[0]).vocab_size


def test_greedy_is_deterministic_with_valid_logprobs_and_versions(dirs: list[Path]) -> None:
    contract.check_greedy(builtin(dirs[0], 4), dirs[0], builtin, _vocab(dirs), "g")


def test_abort_yields_one_finished_abort_output(dirs: list[Path]) -> None:
    contract.check_abort(builtin(dirs[0], 0), _vocab(dirs), "a")


def test_weight_update_swaps_versions_between_steps(dirs: list[Path]) -> None:
    engine = builtin(dirs[0], 1)
    contract.check_weight_update_between_steps(engine, dirs[1], builtin, _vocab(dirs), "w")
    contract.check_greedy(engine, dirs[1], builtin, _vocab(dirs), "g-after")


def test_close_is_idempotent(dirs: list[Path]) -> None:
    contract.check_close(builtin, dirs[0], _vocab(dirs))


def test_both_engines_satisfy_the_protocol_statically() -> None:
    """Runtime half of the static check (mypy checks `rollart_hpc.inference.engines` returns an Engine)."""
    from rollart_hpc.inference.engines import ENGINES
    from rollart_hpc.inference.vllm_engine import VLLMEngine

    assert set(ENGINES) == {"builtin", "vllm"}
    for cls in (LLMEngine, VLLMEngine):
        for name in METHODS:
            assert callable(getattr(cls, name)), f"{cls.__name__}.{name}"
        assert isinstance(cls.version, property)
