"""Engine lifecycle: slots, abort, errors, stop conditions, seeds, weight swaps, the asyncio front."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rollart_hpc.contracts.generation import LLMClient, RequestOutput, SamplingParams
from rollart_hpc.inference.async_engine import AsyncEngine
from rollart_hpc.inference.engine import LLMEngine
from rollart_hpc.models.checkpoint import load_weights
from rollart_hpc.models.config import load_config
from rollart_hpc.models.tiny import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SMALL = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256}


@pytest.fixture(scope="module")
def w1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("w1"), family="qwen2", seed=1, init_std=0.08, **SMALL)


@pytest.fixture(scope="module")
def w2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("w2"), family="qwen2", seed=2, init_std=0.08, **SMALL)


def _engine(model_dir: Path, **kwargs: object) -> LLMEngine:
    kwargs.setdefault("eos_token_ids", ())
    return LLMEngine.from_pretrained(
        model_dir, num_slots=kwargs.pop("num_slots", 2), max_model_len=48, **kwargs
    )


def _drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    return done


def test_abort_frees_slot_for_waiting_request(w1_dir: Path) -> None:
    engine = _engine(w1_dir, num_slots=2)
    long = SamplingParams(temperature=0.0, max_tokens=30)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [5, 6, 7], long)
    engine.step()
    engine.step()
    assert engine.num_running() == 2
    assert engine.abort("a") and not engine.abort("nope")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finish_reason == "abort" and len(outs["a"].token_ids) == 2
    assert engine.num_running() == 2  # "c" took the freed slot at once
    rest = _drain(engine)
    assert len(rest["b"].token_ids) == 30 and len(rest["c"].token_ids) == 30


def test_abort_of_waiting_request(w1_dir: Path) -> None:
    engine = _engine(w1_dir, num_slots=1)
    engine.add_request("a", [5, 6], GREEDY)
    engine.add_request("b", [5, 6], GREEDY)
    assert engine.abort("b")
    outs = _drain(engine)
    assert outs["b"].finish_reason == "abort" and outs["b"].token_ids == []
    assert outs["a"].finish_reason == "length"


def test_prompt_over_context_limit_is_an_error_output_and_others_continue(w1_dir: Path) -> None:
    engine = _engine(w1_dir)
    engine.add_request("ok", [5, 6, 7], GREEDY)
    engine.add_request("long", list(range(3, 51)), GREEDY)
    engine.add_request("bad-token", [5, 10**6], GREEDY)
    engine.add_request("empty", [], GREEDY)
    outs = _drain(engine)
    for rid in ("long", "bad-token", "empty"):
        assert outs[rid].finish_reason == "error" and outs[rid].error and outs[rid].token_ids == []
    assert "context limit is 48" in str(outs["long"].error)
    assert outs["ok"].finish_reason == "length" and len(outs["ok"].token_ids) == 8


def test_duplicate_request_id_raises(w1_dir: Path) -> None:
    engine = _engine(w1_dir)
    engine.add_request("a", [5], GREEDY)
    with pytest.raises(ValueError, match="already"):
        engine.add_request("a", [6], GREEDY)


def test_generation_stops_at_context_limit(w1_dir: Path) -> None:
    engine = _engine(w1_dir)
    engine.add_request("a", list(range(3, 43)), SamplingParams(temperature=0.0, max_tokens=100))
    out = _drain(engine)["a"]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 48


def test_stop_token_ids_and_eos(w1_dir: Path) -> None:
    free = _drain_one(_engine(w1_dir), SamplingParams(temperature=0.0, max_tokens=8))
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    by_param = _drain_one(
        _engine(w1_dir), SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(stop_tok,))
    )
    by_eos = _drain_one(
        _engine(w1_dir, eos_token_ids=(stop_tok,)), SamplingParams(temperature=0.0, max_tokens=8)
    )
    for out in (by_param, by_eos):
        assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]


def test_stop_string_truncates_text(w1_dir: Path) -> None:
    engine = _engine(w1_dir)
    free = _drain_one(engine, SamplingParams(temperature=0.0, max_tokens=8))
    assert free.text == engine.tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop = free.text[3:5]
    assert stop
    out = _drain_one(_engine(w1_dir), SamplingParams(temperature=0.0, max_tokens=8, stop=(stop,)))
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]


def _drain_one(engine: LLMEngine, sampling: SamplingParams, prompt: list[int] | None = None) -> RequestOutput:
    engine.add_request("one", prompt or [5, 9, 11, 4], sampling)
    return _drain(engine)["one"]


def test_seeded_sampling_is_independent_of_batch(w1_dir: Path) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=123)
    alone = _drain_one(_engine(w1_dir), seeded)
    engine = _engine(w1_dir, num_slots=3)
    engine.add_request("noise1", [7, 8], SamplingParams(temperature=1.0, max_tokens=10))
    engine.step()
    engine.add_request("one", [5, 9, 11, 4], seeded)
    engine.add_request("noise2", [3], SamplingParams(temperature=1.0, max_tokens=10, seed=9))
    together = _drain(engine)
    assert together["one"].token_ids == alone.token_ids
    assert together["one"].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    unseeded = [_drain_one(_engine(w1_dir, seed=s), SamplingParams(max_tokens=10)).token_ids for s in (1, 2)]
    assert unseeded[0] != unseeded[1]


def test_weight_swap_mid_generation_matches_fresh_engine(w1_dir: Path, w2_dir: Path) -> None:
    engine = _engine(w1_dir, version=1)
    prompt = [5, 9, 11, 4, 17]
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=12))
    for _ in range(4):
        engine.step()
    engine.update_weights(load_weights(w2_dir).items(), version=2)
    assert engine.version == 1 and engine.has_staged_weights()
    out = _drain(engine)["a"]
    assert engine.version == 2
    assert out.versions == [1] * 4 + [2] * 8
    fresh = _engine(w2_dir, version=2)
    ref = _drain_one(fresh, SamplingParams(temperature=0.0, max_tokens=8), prompt=prompt + out.token_ids[:4])
    assert out.token_ids[4:] == ref.token_ids
    assert out.logprobs[4:] == pytest.approx(ref.logprobs, abs=1e-6)
    assert ref.versions == [2] * 8


def test_partial_update_and_name_checks(w1_dir: Path, w2_dir: Path) -> None:
    engine = _engine(w1_dir)
    w2 = load_weights(w2_dir)
    name = "model.layers.0.self_attn.k_proj.bias"
    engine.update_weights([(name, w2[name]), ("lm_head.weight", w2["model.embed_tokens.weight"])], version=5)
    engine.step()
    assert engine.version == 5
    active = engine.weights()
    assert torch.equal(active[name], w2[name])
    assert torch.equal(active["model.norm.weight"], load_weights(w1_dir)["model.norm.weight"])
    with pytest.raises(ValueError, match="unknown weight names"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", w2[name])], version=6)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([(name, torch.zeros(3))], version=6)


def test_update_weights_copies_sender_tensors(w1_dir: Path) -> None:
    engine = _engine(w1_dir)
    config = load_config(w1_dir)
    norm = torch.ones(config.hidden_size)
    engine.update_weights([("model.norm.weight", norm)], version=1)
    norm.mul_(7.0)
    engine.step()
    assert torch.equal(engine.weights()["model.norm.weight"], torch.ones(config.hidden_size))


def test_a_landing_writes_the_idle_half_of_a_double_buffer_and_swaps_between_steps(
    w1_dir: Path, w2_dir: Path
) -> None:
    """Versions land in the snapshot no forward reads (the same two snapshots alternate, nothing else
    allocated per version): bucket by bucket through `land`, or straight into `targets`; the engine keeps
    sampling the old version until the commit, and the swap comes between two steps."""
    engine = _engine(w1_dir, version=1, linear_backend="dense")
    w1, w2 = load_weights(w1_dir), load_weights(w2_dir)
    engine.add_request("a", [5, 9, 11], SamplingParams(temperature=0.0, max_tokens=12))
    engine.step()
    first = engine.weights()["model.layers.0.mlp.up_proj.weight"].data_ptr()
    pointers = []
    for version, source in ((2, w2), (3, w1), (4, w2)):
        landing = engine.begin_weights(version)
        names = list(source)
        half = len(names) // 2
        landing.land([(n, source[n]) for n in names[:half]])  # as buckets arrive
        engine.step()  # generation goes on at the active version meanwhile
        assert engine.version == version - 1 and not engine.has_staged_weights()
        for name in names[half:]:  # as a receiver landing lone buckets in place
            landing.targets[name].copy_(source[name])
        landing.commit(names[half:])
        assert engine.version == version - 1 and engine.has_staged_weights()
        engine.step()
        assert engine.version == version
        active = engine.weights()
        assert all(torch.equal(active[n], source[n]) for n in names)
        pointers.append(active["model.layers.0.mlp.up_proj.weight"].data_ptr())
    assert pointers[1] == first and pointers[0] == pointers[2] != first
    out = _drain(engine)["a"]
    assert out.versions[:4] == [1, 1, 2, 2] and out.versions[-1] == 4


def test_async_front_shares_batch_and_matches_sync(w1_dir: Path, w2_dir: Path) -> None:
    prompts = {f"r{i}": [5 + i, 9, 11, 4 + 2 * i] for i in range(6)}
    sync = _engine(w1_dir, num_slots=6)
    for rid, p in prompts.items():
        sync.add_request(rid, p, GREEDY)
    expected = _drain(sync)
    front = AsyncEngine(_engine(w1_dir, num_slots=3))
    client: LLMClient = front

    async def scenario() -> None:
        outs = await asyncio.gather(*(client.generate(rid, p, GREEDY) for rid, p in prompts.items()))
        for out in outs:
            assert out.token_ids == expected[out.request_id].token_ids
        long = asyncio.create_task(
            client.generate("long", [5, 6], SamplingParams(temperature=0.0, max_tokens=40))
        )
        for _ in range(3):  # let the request reach the engine; a fixed sleep let a fast box finish it first
            await asyncio.sleep(0)
        await client.abort("long")
        aborted = await long
        assert aborted.finish_reason == "abort" and len(aborted.token_ids) < 40
        await asyncio.to_thread(front.update_weights, load_weights(w2_dir).items(), 7)
        await asyncio.wait_for(front.wait_for_version(7), timeout=10)
        after = await client.generate("after", [5, 6], SamplingParams(temperature=0.0, max_tokens=3))
        assert after.versions == [7, 7, 7]
        error = await client.generate("too-long", list(range(3, 60)), GREEDY)
        assert error.finish_reason == "error"

    try:
        asyncio.run(scenario())
    finally:
        front.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(front.generate("late", [5], GREEDY))
