"""Parity of the built-in engine's forward pass and sampling with HF transformers (fp32, tiny models)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import engine_contract as contract
import pytest
import torch

from rollart_hpc.contracts.generation import SamplingParams
from rollart_hpc.inference.decoder import Decoder, Segment, SlotKVCache, _inv_freq
from rollart_hpc.inference.engine import LLMEngine
from rollart_hpc.inference.packed import pack_weights
from rollart_hpc.models.checkpoint import load_weights
from rollart_hpc.models.config import load_config
from rollart_hpc.models.tiny import make_tiny_model

FAMILIES = ("llama", "qwen2", "qwen3")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# Llama 3 scaling with a short original context, so that the 64 positions of these tests meet all three
# regimes (high frequencies kept, medium ones smoothed, low ones divided by the factor).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _make(root: Path, family: str, tied: bool, rope_scaling: dict | None = None) -> Path:
    return make_tiny_model(
        root / f"{family}-{tied}-{bool(rope_scaling)}",
        family=family,
        seed=3,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,  # != hidden_size / num_heads (32), as in several Qwen3 sizes
        intermediate_size=256,
        tie_word_embeddings=tied,
        rope_theta=500.0,
        init_std=0.08,
        rope_scaling=rope_scaling,
    )


@pytest.fixture(
    scope="module",
    params=[
        ("llama", False, None),
        ("llama", True, LLAMA3_ROPE),
        ("qwen2", True, None),
        ("qwen3", False, None),
    ],
    ids=["llama-untied", "llama3-rope", "qwen2-tied", "qwen3-untied"],
)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, tied, rope_scaling = request.param
    return _make(tmp_path_factory.mktemp("models"), family, tied, rope_scaling)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("backend", ["dense", "onednn"])
def test_prefill_and_every_decode_step_match_hf_logits(
    model_dir: Path, hf_model: torch.nn.Module, backend: str
) -> None:
    if backend == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    config = load_config(model_dir)
    weights = pack_weights(config, load_weights(model_dir, config), torch.float32, backend)
    decoder = Decoder(config, max_len=64)
    cache = SlotKVCache(config, num_slots=3, max_len=64, dtype=torch.float32)
    ids = contract.prompts((9,), 0, config.vocab_size)[0]
    with torch.inference_mode():
        prefill = decoder.extend(weights, cache, 1, torch.tensor(ids), 0, all_logits=True)
        assert (prefill - _hf_logits(hf_model, ids)).abs().max() < 1e-4
        last = prefill[-1]
        for _ in range(10):
            nxt = int(last.argmax())
            ids.append(nxt)
            last = decoder.forward(weights, cache, torch.tensor([nxt]), [Segment(1, len(ids) - 1, 1)])[0]
            assert (last - _hf_logits(hf_model, ids)[-1]).abs().max() < 1e-4


def test_greedy_continuation_identical_to_hf_generate(model_dir: Path, hf_model: torch.nn.Module) -> None:
    engine = LLMEngine.from_pretrained(model_dir, num_slots=2, max_model_len=64, eos_token_ids=())
    prompt = contract.prompts((11,), 0, engine.config.vocab_size)[0]
    steps = 32
    out = contract.run(engine, {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=steps))})["a"]
    with torch.inference_mode():
        ref = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    assert out.token_ids == ref[0, len(prompt) :].tolist()
    assert out.finish_reason == "length" and out.versions == [0] * steps
    hf_lp = _hf_logits(hf_model, prompt + out.token_ids).log_softmax(-1)
    expected = [float(hf_lp[len(prompt) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-4)


def test_rope_inverse_frequencies_equal_transformers(model_dir: Path, hf_model: torch.nn.Module) -> None:
    """The engine's RoPE inverse frequencies are bit-identical to transformers' for the model's rope type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = load_config(model_dir)
    rope_type = config.rope_scaling.get("rope_type", "default")
    rotary = hf_model.model.rotary_emb
    compute = (
        rotary.compute_default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]
    )
    expected, _ = compute(hf_model.config)
    ours = _inv_freq(config)
    assert ours.dtype == expected.dtype and torch.equal(ours, expected)
    assert torch.equal(rotary.inv_freq, expected)
    if rope_type == "llama3":  # the scaling acts on these positions: the unscaled table differs
        plain = _inv_freq(dataclasses.replace(config, rope_scaling={}))
        assert not torch.equal(plain, ours) and torch.equal(plain[:4], ours[:4])


def test_sampled_logprobs_equal_hf_log_softmax(model_dir: Path, hf_model: torch.nn.Module) -> None:
    engine = LLMEngine.from_pretrained(model_dir, num_slots=2, max_model_len=64, eos_token_ids=())
    prompt = contract.prompts((7,), 0, engine.config.vocab_size)[0]
    plain = SamplingParams(temperature=1.0, max_tokens=10, seed=5)
    filtered = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=10, seed=6)
    outs = contract.run(engine, {"plain": (prompt, plain), "filtered": (prompt, filtered)})
    logits = _hf_logits(hf_model, prompt + outs["plain"].token_ids)
    lp = logits.log_softmax(-1)
    expected = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(outs["plain"].token_ids)]
    assert outs["plain"].logprobs == pytest.approx(expected, abs=1e-4)
    tokens = outs["filtered"].token_ids
    logits = _hf_logits(hf_model, prompt + tokens)[len(prompt) - 1 : -1] / 0.7
    for row, tok, got in zip(logits, tokens, outs["filtered"].logprobs, strict=True):
        probs = row.softmax(-1)
        top = probs.topk(20)
        kept = top.values / top.values.sum()
        cut = int(((kept.cumsum(0) - kept) < 0.9).sum())
        allowed = top.indices[:cut]
        assert tok in allowed.tolist()
        masked = torch.full_like(row, float("-inf"))
        masked[allowed] = row[allowed]
        assert got == pytest.approx(float(masked.log_softmax(-1)[tok]), abs=1e-4)


def test_batched_equals_unbatched_greedy(model_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(model_dir, num_slots=4, max_model_len=64, eos_token_ids=())
    prompts = contract.prompts((5, 13, 8, 21), 1, engine.config.vocab_size)
    together = contract.run(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        alone = contract.run(engine, {f"alone{i}": (p, GREEDY)})[f"alone{i}"]
        assert together[str(i)].token_ids == alone.token_ids


def test_request_added_mid_flight_matches_alone(model_dir: Path) -> None:
    engine = LLMEngine.from_pretrained(model_dir, num_slots=3, max_model_len=64, eos_token_ids=())
    first, late = contract.prompts((6, 10), 2, engine.config.vocab_size)
    long = SamplingParams(temperature=0.0, max_tokens=20)
    engine.add_request("first", first, long)
    for _ in range(5):
        assert engine.step() == []
    outs = contract.run(engine, {"late": (late, GREEDY)}, in_flight=("first",))
    alone = contract.run(
        LLMEngine.from_pretrained(model_dir, num_slots=1, max_model_len=64, eos_token_ids=()),
        {"x": (late, GREEDY)},
    )
    assert outs["late"].token_ids == alone["x"].token_ids
    assert len(outs["first"].token_ids) == 20


def test_chunked_prefill_gives_same_tokens(model_dir: Path) -> None:
    prompts = contract.prompts((30, 17), 4, load_config(model_dir).vocab_size)
    requests = {str(i): (p, GREEDY) for i, p in enumerate(prompts)}
    whole = contract.run(
        LLMEngine.from_pretrained(model_dir, num_slots=2, max_model_len=64, eos_token_ids=()), requests
    )
    chunked_engine = LLMEngine.from_pretrained(
        model_dir, num_slots=2, max_model_len=64, eos_token_ids=(), max_num_batched_tokens=7
    )
    chunked = contract.run(chunked_engine, requests)
    for rid in requests:
        assert chunked[rid].token_ids == whole[rid].token_ids


def test_batch_invariant_requests_are_bit_identical_together_or_alone(model_dir: Path) -> None:
    """With batch_invariant, sampled tokens and their log-probs are the same bits whichever requests share
    the steps (a long prompt chunked next to decodes, a request added mid-flight, other slots)."""
    vocab = load_config(model_dir).vocab_size
    prompts = contract.prompts((5, 40, 8, 21), 6, vocab)

    def sampling(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=10, seed=100 + i)

    def engine(num_slots: int) -> LLMEngine:
        return LLMEngine.from_pretrained(
            model_dir, num_slots=num_slots, max_model_len=96, eos_token_ids=(), max_num_batched_tokens=16,
            batch_invariant=True,
        )  # fmt: skip

    together = engine(3)
    together.add_request("0", prompts[0], sampling(0))
    together.step()
    got = contract.run(
        together, {str(i): (p, sampling(i)) for i, p in enumerate(prompts) if i}, in_flight=("0",)
    )
    for i, p in enumerate(prompts):
        alone_engine = engine(1)
        alone = contract.run(alone_engine, {"x": (p, sampling(i))})["x"]
        assert got[str(i)].token_ids == alone.token_ids
        assert got[str(i)].logprobs == alone.logprobs  # exact: same bits
