"""`load_tokenizer` loads what `AutoTokenizer` loads: the same class and the same ids, chat text and special
tokens, for every model family the project writes (and for SmolLM2, in test_models_tiny.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart_hpc.models.tiny import make_tiny_model
from rollart_hpc.models.tokenizer import DIRECT_MODEL_TYPES, direct_class, load_tokenizer

CHAT = [
    {"role": "system", "content": "You play a text game."},
    {"role": "user", "content": "You see a red key. 12 + 30 = ?"},
    {"role": "assistant", "content": "take the red key"},
    {"role": "user", "content": "Taken. <|im_end|> ünïcödé"},
]


def assert_same_tokenizer(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    auto, ours = AutoTokenizer.from_pretrained(model_dir), load_tokenizer(model_dir)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id", "chat_template"):
        assert getattr(ours, attr) == getattr(auto, attr), attr
    for prompt in (True, False):
        text = auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
        assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt) == text
        ids = auto.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_tokenizer_of_every_family_equals_autotokenizers(tmp_path: Path, family: str) -> None:
    out = make_tiny_model(
        tmp_path / family, family=family, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=64, intermediate_size=64,
    )  # fmt: skip
    assert direct_class(out) == (family in DIRECT_MODEL_TYPES)
    assert_same_tokenizer(out)


def test_an_undeclared_or_remote_tokenizer_class_goes_through_autotokenizer(tmp_path: Path) -> None:
    out = make_tiny_model(
        tmp_path / "m", hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64,
        intermediate_size=64,
    )  # fmt: skip
    assert direct_class(out)
    config_path = out / "tokenizer_config.json"
    declared = json.loads(config_path.read_text())
    for changed in (
        {**declared, "auto_map": {"AutoTokenizer": ["x.Y", None]}},
        {**declared, "tokenizer_class": None},
    ):
        config_path.write_text(json.dumps(changed))
        assert not direct_class(out)
    config_path.write_text(json.dumps(declared))
    (out / "config.json").write_text("{not json")
    assert not direct_class(out)
