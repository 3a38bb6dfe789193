"""Shared test setup. TRITON_INTERPRET must be set before anything imports triton."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fcntl  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def python() -> str:
    return sys.executable


# The slurm-marked tests share the two nodes of the local test cluster: a job queued behind another test's
# job would wait for it, and some tests expect both nodes idle. Under pytest-xdist (`-n 2`) they therefore
# run one at a time, whichever worker holds them, through an exclusive lock on one file.
SLURM_TEST_LOCK = Path(tempfile.gettempdir()) / "rollart-hpc-slurm-tests.lock"


@pytest.fixture(autouse=True)
def _one_slurm_test_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    with SLURM_TEST_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# The environment of the in-process vLLM engines of the vllm-marked tests, set for the session and restored.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
VLLM_MAX_LEN = 256


@pytest.fixture(scope="session")
def vllm_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in VLLM_ENV}
    os.environ.update(VLLM_ENV)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def make_vllm_test_model(root: Path, family: str, tied: bool, seed: int) -> Path:
    """A tiny fp32 checkpoint of `family` for the vLLM adapter tests (Qwen3: head_dim 64 != hidden / heads)."""
    from rollart_hpc.models.tiny import make_tiny_model

    return make_tiny_model(
        root / f"{family}-{tied}-{seed}",
        family=family,
        seed=seed,
        hidden_size=128,
        num_layers=2,
        num_heads=4 if family == "qwen3" else 2,
        num_kv_heads=2 if family == "qwen3" else 1,
        head_dim=64,
        intermediate_size=256,
        tie_word_embeddings=tied,
        rope_theta=500.0,
        init_std=0.08,
    )


@pytest.fixture(
    scope="session",
    params=[("llama", False), ("qwen2", True), ("qwen3", False)],
    ids=["llama-untied", "qwen2-tied", "qwen3-untied"],
)
def vllm_state(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vllm_env: None
) -> Iterator[dict[str, Any]]:
    """One vLLM engine per model (untied Llama, tied Qwen2, untied Qwen3) for every vllm-marked test of
    that model, in any module: building one takes most of a test's time on CPU. Each test reads which
    of the two checkpoints the engine holds from `loaded` (and records a switch), so order does not matter."""
    from rollart_hpc.inference.vllm_engine import VLLMEngine, VLLMSettings
    from rollart_hpc.models.config import load_config

    family, tied = request.param
    root = tmp_path_factory.mktemp("vllm-models")
    dirs = [make_vllm_test_model(root, family, tied, seed) for seed in (3, 4)]
    settings = VLLMSettings(num_slots=8, max_model_len=VLLM_MAX_LEN, dtype="float32", ignore_eos=True)
    engine = VLLMEngine(dirs[0], settings)
    st = {"engine": engine, "dirs": dirs, "loaded": 0, "vocab": load_config(dirs[0]).vocab_size}
    yield st
    engine.close()
