"""The vLLM adapter's pure parts, without vLLM: staging buffer shared with another process, the chunks of a
staged update, the worker extension's load phases on a fake worker, the engine arguments built from the
config, and the conversion of vLLM's log-probs and version spans."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollart_hpc.config.loader import build
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.inference.vllm_engine import (
    VLLMEngineError,
    VLLMSettings,
    engine_arg_values,
    sampled_logprobs,
    span_versions,
)
from rollart_hpc.inference.vllm_staging import StagingBuffer, chunk_layouts, open_staging, staged_tensors
from rollart_hpc.inference.vllm_worker import RollartWorkerExtension


def _named(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(33, 8, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(7, generator=g).to(torch.float16),
        "lm_head.weight": torch.randn(33, 8, generator=g),
    }


def _child_sums(handle: bytes, layout_bytes: bytes, requests: Any, replies: Any) -> None:
    """Map the buffer once, then report the tensors' sums each time the parent asks."""
    buffer = open_staging(handle)
    while requests.get(timeout=120):
        replies.put({name: float(t.double().sum()) for name, t in staged_tensors(buffer, layout_bytes)})


def _whole(named: dict[str, torch.Tensor]) -> Any:
    (layout,) = chunk_layouts(list(named.items()), 1 << 20)
    return layout


def test_chunks_hold_consecutive_tensors_aligned_within_the_capacity() -> None:
    named = _named(0)  # 1056, 128, 14 and 1056 bytes
    assert [s.name for s in _whole(named).slots] == list(named)
    chunks = chunk_layouts(list(named.items()), 1024)
    assert [[s.name for s in c.slots] for c in chunks] == [[n] for n in list(named)[:1]] + [
        list(named)[1:3],
        list(named)[3:],
    ]
    assert all(
        c.num_buckets == 1 and all(s.bucket == 0 and s.offset % 64 == 0 for s in c.slots) for c in chunks
    )
    assert [c.total_nbytes for c in chunks] == [1088, 192, 1088]  # a larger tensor alone, in its own size


def test_staging_buffer_is_read_by_another_process_and_rewritten_in_place() -> None:
    named = _named(1)
    layout = _whole(named)
    staging = StagingBuffer(layout.total_nbytes, torch.device("cpu"))
    ctx = mp.get_context("fork")  # a separate process that maps the buffer by its handle alone
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child_sums, args=(staging.handle, layout.to_bytes(), requests, replies))
    child.start()
    try:
        for version in (1, 2):  # the second write is seen through the mapping the child already holds
            named = _named(version)
            staging.write(layout, named)
            requests.put(True)
            sums = replies.get(timeout=120)
            assert sums == pytest.approx({n: float(t.double().sum()) for n, t in named.items()})
        requests.put(False)
        child.join(60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        path = staging.path
        staging.close()
    assert path is not None and not path.exists()


def test_staging_write_rejects_other_tensors_and_chunks_larger_than_the_buffer() -> None:
    named = _named(0)
    staging = StagingBuffer(1024, torch.device("cpu"))
    try:
        small = chunk_layouts(list(named.items()), 1024)[1]
        with pytest.raises(ValueError, match="do not match the layout"):
            staging.write(small, {"model.norm.weight": torch.ones(7, dtype=torch.float16)})
        with pytest.raises(ValueError, match="at most 1024 bytes"):
            staging.write(_whole(named), named)
    finally:
        staging.close()


class _FakeModel:
    """Keeps the tensors it is given until finalize, as vLLM's layerwise reload does for a layer that is
    not complete yet (so tensors still pointing into the staging buffer would be overwritten)."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events
        self.held: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.events.append(("load", [name for name, _ in weights]))
        self.held.extend(weights)


class _FakeWorker(RollartWorkerExtension):
    def __init__(self, tied: bool, model: _FakeModel) -> None:
        self.device = torch.device("cpu")
        self.model_config = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=tied))
        self.model_runner = SimpleNamespace(get_model=lambda: model)


def _fake_reload(monkeypatch: pytest.MonkeyPatch, events: list[Any]) -> None:
    reload = SimpleNamespace(
        initialize_layerwise_reload=lambda model: events.append(("begin", model)),
        finalize_layerwise_reload=lambda model, config: events.append(("finish", model, config)),
    )
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", reload)


def test_worker_extension_loads_chunk_by_chunk_between_begin_and_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[Any] = []
    _fake_reload(monkeypatch, events)
    named, model = _named(4), _FakeModel(events)
    worker = _FakeWorker(tied=False, model=model)
    chunks = chunk_layouts(list(named.items()), 1024)
    staging = StagingBuffer(max(c.total_nbytes for c in chunks), torch.device("cpu"))
    try:
        worker.rollart_begin_load()
        loaded = 0
        for chunk in chunks:
            staging.write(chunk, named)
            loaded += worker.rollart_load_staged(staging.handle, chunk.to_bytes())
            mapped = worker._rollart_staging
        worker.rollart_finish_load()
        assert worker._rollart_staging is mapped  # the mapping is opened once per buffer
    finally:
        staging.close()
    assert loaded == 4
    assert [e[0] for e in events] == ["begin", "load", "load", "load", "finish"]
    assert events[0][1] is model and events[-1][1:] == (model, worker.model_config)
    assert [n for _, names in events[1:-1] for n in names] == list(named)
    for name, tensor in model.held:  # intact after later chunks rewrote the staging buffer
        assert torch.equal(tensor, named[name]) and tensor.dtype == named[name].dtype


def test_worker_extension_skips_a_tied_head(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[Any] = []
    _fake_reload(monkeypatch, events)
    monkeypatch.setitem(
        sys.modules, "vllm.platforms", SimpleNamespace(current_platform=SimpleNamespace(is_cpu=lambda: False))
    )
    named, model = _named(5), _FakeModel(events)
    worker = _FakeWorker(tied=True, model=model)
    layout = _whole(named)
    staging = StagingBuffer(layout.total_nbytes, torch.device("cpu"))
    try:
        staging.write(layout, named)
        worker.rollart_begin_load()
        assert worker.rollart_load_staged(staging.handle, layout.to_bytes()) == 3
        worker.rollart_finish_load()
    finally:
        staging.close()
    assert [n for n, _ in model.held] == [n for n in named if n != "lm_head.weight"]


def test_vllm_engine_arguments_follow_the_rollout_and_trainer_sections() -> None:
    config = build(
        Config,
        {
            "rollout": {
                "engine": "vllm", "tensor_parallel_size": 2, "max_model_len": 300, "num_slots": 6,
                "vllm": {"gpu_memory_utilization": 0.6, "enforce_eager": True},
            },
            "trainer": {"precision": "bf16", "bucket_mb": 2.0},
        },
    )  # fmt: skip
    settings = VLLMSettings.from_config(config.rollout, config.trainer)
    assert settings == VLLMSettings(
        num_slots=6, max_model_len=300, tensor_parallel_size=2, dtype="bfloat16",
        gpu_memory_utilization=0.6, enforce_eager=True, staging_bytes=2 << 20,
    )  # fmt: skip
    fp32 = build(Config, {"rollout": {"engine": "vllm"}})
    assert VLLMSettings.from_config(fp32.rollout, fp32.trainer).dtype == "float32"
    assert VLLMSettings.from_config(fp32.rollout, fp32.trainer).enforce_eager is None
    pinned = build(
        Config,
        {"rollout": {"engine": "vllm", "vllm": {"dtype": "float32"}}, "trainer": {"precision": "bf16"}},
    )
    assert VLLMSettings.from_config(pinned.rollout, pinned.trainer).dtype == "float32"
    keys = ("model", "seed", "enable_prefix_caching")
    assert settings.enable_prefix_caching and not settings.engine_kwargs
    args = engine_arg_values(Path("/m"), settings, 3, on_cpu=False, batched_tokens=8192)
    assert {k: args[k] for k in keys} == {"model": "/m", "seed": 3, "enable_prefix_caching": True}
    assert (args["dtype"], args["max_model_len"], args["max_num_seqs"], args["tensor_parallel_size"]) == (
        "bfloat16", 300, 6, 2,
    )  # fmt: skip
    assert (args["gpu_memory_utilization"], args["enforce_eager"]) == (0.6, True)
    assert args["logprobs_mode"] == "processed_logprobs"
    plain = VLLMSettings(num_slots=6, max_model_len=300, dtype="float32", gpu_memory_utilization=0.85)
    graphs = engine_arg_values(Path("/m"), plain, 0, on_cpu=False, batched_tokens=8192)
    assert graphs["enforce_eager"] is False


def test_vllm_engine_arguments_on_cpu_size_the_kv_cache_and_leave_gpu_memory_alone(tmp_path: Path) -> None:
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_attention_heads": 2,
        "hidden_size": 128, "num_hidden_layers": 1, "num_key_value_heads": 1, "intermediate_size": 256,
        "vocab_size": 512, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    settings = VLLMSettings(num_slots=4, max_model_len=64, dtype="float32", gpu_memory_utilization=0.85)
    args = engine_arg_values(tmp_path, settings, 0, on_cpu=True, batched_tokens=32)
    assert "gpu_memory_utilization" not in args and args["enforce_eager"] is True
    assert args["kv_cache_memory_bytes"] == 64 << 20 and args["max_num_batched_tokens"] == 64
    assert args["enable_chunked_prefill"] is False


@pytest.mark.parametrize("key", ["gpu_memory_utilization=0.5", "dtype='bfloat16'", "enforce_eager=true"])
def test_vllm_keys_with_the_builtin_engine_are_refused(key: str) -> None:
    from rollart_hpc.config.loader import apply_overrides

    name = key.split("=")[0]
    with pytest.raises(UsageError, match=rf"^rollout\.vllm\.{name}: only the vLLM engine uses it"):
        build(Config, apply_overrides({}, [f"rollout.vllm.{key}"]))


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Span:
    version: str
    start: int
    end: int


def test_sampled_logprobs_pick_the_sampled_token_entry() -> None:
    entries = [{5: _Logprob(-0.5)}, {9: _Logprob(-1.25), 3: _Logprob(-2.0)}]
    assert sampled_logprobs(entries, [5, 9]) == [-0.5, -1.25]
    assert sampled_logprobs(None, []) == []
    with pytest.raises(VLLMEngineError, match="no log-prob"):
        sampled_logprobs(None, [5])


def test_span_versions_expand_to_one_version_per_token() -> None:
    assert span_versions([_Span("3", 0, 2), _Span("4", 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert span_versions(None, 0) == []
    with pytest.raises(VLLMEngineError, match="gap"):
        span_versions([_Span("3", 0, 2), _Span("4", 3, 5)], 5)
    with pytest.raises(VLLMEngineError, match="cover 2 of 5"):
        span_versions([_Span("3", 0, 2)], 5)
    with pytest.raises(VLLMEngineError, match="no weight version"):
        span_versions(None, 1)
