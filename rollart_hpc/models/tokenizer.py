"""The tokenizer of a model directory, as `transformers.AutoTokenizer` would load it.

AutoTokenizer first imports transformers' registry of every model family (it reads each family's
`__init__` to build the lazy import table) and the model's config class, about 2.5 CPU-seconds in each
process that loads a tokenizer; an RL world loads one in its env, rollout and trainer ranks. For a
directory whose `tokenizer_config.json` names `TokenizersBackend`, carries no `auto_map`, and whose model
type is one for which AutoTokenizer keeps that declared class (`DIRECT_MODEL_TYPES`, checked against
AutoTokenizer by tests/test_models_tokenizer.py for the pinned transformers), AutoTokenizer's answer is
that class's `from_pretrained`, so it is called directly. Anything else goes through AutoTokenizer (for
example Qwen2, whose declared class transformers overrides with its own Qwen2Tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DIRECT_CLASS = "TokenizersBackend"
DIRECT_MODEL_TYPES = ("llama", "qwen3")


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def direct_class(model_dir: Path) -> bool:
    """Whether AutoTokenizer would load `model_dir` as the `TokenizersBackend` it declares."""
    declared = _json(model_dir / "tokenizer_config.json")
    return (
        declared.get("tokenizer_class") == DIRECT_CLASS
        and "auto_map" not in declared
        and _json(model_dir / "config.json").get("model_type") in DIRECT_MODEL_TYPES
        and (model_dir / "tokenizer.json").is_file()
    )


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer of the HF model directory `model_dir` (local files only)."""
    model_dir = Path(model_dir)
    if direct_class(model_dir):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
