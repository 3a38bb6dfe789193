"""The vLLM adapter's pure parts, without vLLM: staging buffer shared with another process, the worker
extension's load path on a fake worker, and the conversion of vLLM's log-probs and version spans."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollart_hpc.inference.vllm_engine import VLLMEngineError, sampled_logprobs, span_versions
from rollart_hpc.inference.vllm_staging import (
    StagingBuffer,
    open_staging,
    single_bucket_layout,
    staged_tensors,
)
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


def test_single_bucket_layout_holds_every_tensor_aligned() -> None:
    layout = single_bucket_layout(_named(0))
    assert layout.num_buckets == 1
    assert [s.name for s in layout.slots] == list(_named(0))
    assert all(s.offset % 64 == 0 for s in layout.slots)


def test_staging_buffer_is_read_by_another_process_and_rewritten_in_place() -> None:
    named = _named(1)
    staging = StagingBuffer(single_bucket_layout(named), torch.device("cpu"))
    ctx = mp.get_context("fork")  # a separate process that maps the buffer by its handle alone
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child_sums, args=(staging.handle, staging.layout_bytes, requests, replies))
    child.start()
    try:
        for version in (1, 2):  # the second write is seen through the mapping the child already holds
            named = _named(version)
            staging.write(named)
            requests.put(True)
            sums = replies.get(timeout=120)
            assert sums == pytest.approx({n: float(t.double().sum()) for n, t in named.items()})
        requests.put(False)
        child.join(60)
        assert child.exitcode == 0
        assert staging.matches(single_bucket_layout(_named(3)))
        assert not staging.matches(single_bucket_layout({"x": torch.ones(3)}))
    finally:
        if child.is_alive():
            child.kill()
        path = staging.path
        staging.close()
    assert path is not None and not path.exists()


def test_staging_write_rejects_other_tensors() -> None:
    staging = StagingBuffer(single_bucket_layout(_named(0)), torch.device("cpu"))
    try:
        with pytest.raises(ValueError, match="do not match the layout"):
            staging.write({"model.norm.weight": torch.ones(7, dtype=torch.float16)})
    finally:
        staging.close()


class _FakeWorker(RollartWorkerExtension):
    def __init__(self, tied: bool) -> None:
        self.model_config = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=tied))
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        self.loaded = [(name, t.clone()) for name, t in weights_iterator]


def test_worker_extension_loads_every_staged_tensor_with_hf_names() -> None:
    named = _named(4)
    staging = StagingBuffer(single_bucket_layout(named), torch.device("cpu"))
    try:
        staging.write(named)
        worker = _FakeWorker(tied=False)
        assert worker.rollart_load_staged(staging.handle, staging.layout_bytes) == 4
        assert [n for n, _ in worker.loaded] == list(named)
        for name, tensor in worker.loaded:
            assert torch.equal(tensor, named[name]) and tensor.dtype == named[name].dtype
        mapped = worker._rollart_staging
        worker.rollart_load_staged(staging.handle, staging.layout_bytes)
        assert worker._rollart_staging is mapped  # the mapping is opened once per buffer
    finally:
        staging.close()


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
