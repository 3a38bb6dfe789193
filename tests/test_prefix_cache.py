"""The built-in engine's prefix cache: the block index (properties) and multi-turn reuse in the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_contract import run
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollart_hpc.contracts.generation import RequestOutput, SamplingParams
from rollart_hpc.inference.engine import LLMEngine
from rollart_hpc.inference.prefix_cache import PrefixIndex
from rollart_hpc.models.checkpoint import load_weights
from rollart_hpc.models.config import load_config
from rollart_hpc.models.tiny import make_tiny_model

SMALL = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)

tokens = st.lists(st.integers(0, 3), min_size=1, max_size=60)  # a small alphabet: many shared prefixes


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 4),
    ops=st.lists(st.tuples(st.booleans(), tokens), min_size=1, max_size=30),
)
@example(capacity=2, ops=[(True, [0, 0, 0, 0, 0]), (True, [0, 0, 0, 0])])  # found whole in the older row
def test_index_returns_only_true_prefixes_within_capacity(capacity: int, ops: list) -> None:
    index = PrefixIndex(capacity, block=4)
    rows = list(range(10, 10 + capacity))
    held: dict[int, list[int]] = {}  # what each row holds, as the engine would
    for is_store, toks in ops:
        if is_store:
            row = index.victim(rows)
            held[row] = toks
            index.store(row, toks)
            # a prompt extending a just-stored entry finds it whole (when it has a full block): in that row,
            # or in another whose tokens start with the same ones
            if len(toks) >= 4:
                hit = index.lookup(toks + [9])
                assert hit is not None and hit[1] == len(toks) and held[hit[0]][: len(toks)] == toks
                index.store(hit[0], toks)  # a whole match drops the entry; put it back
        else:
            hit = index.lookup(toks)
            if hit is not None:
                row, matched = hit
                assert 4 <= matched < len(toks)
                assert held[row][:matched] == toks[:matched]
        assert len(index) <= capacity
    index.clear()
    assert len(index) == 0 and index.lookup(ops[0][1] * 8) is None


def test_least_recently_used_entry_is_evicted_first() -> None:
    index = PrefixIndex(2, block=2)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    index.store(index.victim([0, 1]), a)
    index.store(index.victim([0, 1]), b)
    assert index.lookup(a + [1]) is not None  # a whole match: dropped, row 0 free again
    index.store(0, a)
    assert index.lookup([2, 2, 2, 5]) == (1, 3)  # touches b (partial match: kept)
    row = index.victim([0, 1])  # a is now the least recently used
    assert row == 0 and index.stats.evicted == 1
    index.store(row, c)
    assert index.lookup(a + [0]) is None and index.lookup(b + [0]) is not None


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("prefix")
    return (
        make_tiny_model(root / "w1", family="qwen2", seed=1, init_std=0.08, **SMALL),
        make_tiny_model(root / "w2", family="qwen2", seed=2, init_std=0.08, **SMALL),
    )


def _engine(model_dir: Path, prefix_slots: int, num_slots: int = 2) -> LLMEngine:
    return LLMEngine.from_pretrained(
        model_dir,
        num_slots=num_slots,
        max_model_len=128,
        eos_token_ids=(),
        prefix_cache_slots=prefix_slots,
    )


def _run(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, RequestOutput]:
    return run(engine, {rid: (prompt, GREEDY) for rid, prompt in prompts.items()})


def _episodes(engine: LLMEngine, turns: int, num: int) -> list[RequestOutput]:
    """`num` interleaved episodes of `turns` turns: each turn's prompt is the episode so far plus an
    observation (the agent loop's shape)."""
    g = torch.Generator().manual_seed(7)
    history = {f"e{i}": torch.randint(3, 200, (20,), generator=g).tolist() for i in range(num)}
    outs = []
    for turn in range(turns):
        done = _run(engine, {f"{e}-t{turn}": list(h) for e, h in history.items()})
        for e in history:
            out = done[f"{e}-t{turn}"]
            outs.append(out)
            observation = torch.randint(3, 200, (6,), generator=g).tolist()
            history[e] = history[e] + out.token_ids + observation
    return outs


def test_turns_reuse_the_cached_episode_and_give_the_same_tokens(model_dirs: tuple[Path, Path]) -> None:
    cached, plain = _engine(model_dirs[0], prefix_slots=4), _engine(model_dirs[0], prefix_slots=0)
    with_cache, without = _episodes(cached, turns=4, num=3), _episodes(plain, turns=4, num=3)
    for a, b in zip(with_cache, without, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    stats = cached.prefix_stats()
    # every turn after the first finds its episode: the previous prompt and reply but the last token
    assert stats["hits"] == 3 * 3
    assert stats["tokens_reused"] > 0.6 * stats["prompt_tokens"]
    assert cached.prefill_tokens == plain.prefill_tokens - stats["tokens_reused"]
    assert cached.decode_tokens == plain.decode_tokens


def test_a_weight_swap_empties_the_cache(model_dirs: tuple[Path, Path]) -> None:
    engine = _engine(model_dirs[0], prefix_slots=2)
    prompt = list(range(3, 40))
    first = _run(engine, {"a": prompt})["a"]
    w2 = load_weights(model_dirs[1], load_config(model_dirs[1]))
    engine.update_weights(w2.items(), version=1)
    again = _run(engine, {"b": prompt + first.token_ids + [5, 6]})["b"]
    fresh = _run(_engine(model_dirs[1], prefix_slots=0), {"b": prompt + first.token_ids + [5, 6]})["b"]
    assert again.token_ids == fresh.token_ids and set(again.versions) == {1}
    stats = engine.prefix_stats()
    assert stats["invalidations"] == 1 and stats["hits"] == 0


def test_eviction_under_more_episodes_than_rows_keeps_outputs_right(model_dirs: tuple[Path, Path]) -> None:
    cached, plain = _engine(model_dirs[0], prefix_slots=2), _engine(model_dirs[0], prefix_slots=0)
    with_cache, without = _episodes(cached, turns=3, num=3), _episodes(plain, turns=3, num=3)
    assert [o.token_ids for o in with_cache] == [o.token_ids for o in without]
    stats = cached.prefix_stats()
    assert stats["evicted"] > 0 and 0 < stats["hits"] < 6


def test_prefix_cache_and_batch_invariant_exclude_each_other(model_dirs: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match="prefix cache and batch_invariant"):
        LLMEngine.from_pretrained(model_dirs[0], num_slots=2, prefix_cache_slots=2, batch_invariant=True)
