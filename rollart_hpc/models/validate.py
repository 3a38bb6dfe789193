"""Check an HF model directory before a run uses it: one line naming the file and what is wrong.

Torch-free and cheap (reads JSON and safetensors headers, never the tensors), so `launch.py` can call it
before it writes anything into the run directory. Checked: `config.json` parses into a supported model;
every safetensors file has a readable header whose tensors fill the file exactly (a truncated or corrupt
file is caught), with the names and shapes the config implies, none missing; the tokenizer
(`tokenizer.json`) parses and every token id it can produce has a row in the model's embedding.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.models.checkpoint import TIED_HEAD_NAME, expected_shapes
from rollart_hpc.models.config import ModelConfig, load_config

_MAX_HEADER_BYTES = 100 * 1024 * 1024


def check_model_dir(model_dir: str | Path) -> ModelConfig:
    """Raise UsageError (one line) when the directory cannot serve as the run's model; return its config."""
    folder = Path(model_dir)
    config = _read_config(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in _weight_files(folder):
        shapes.update(safetensors_shapes(path))
    _check_shapes(folder, config, shapes)
    check_tokenizer(folder, config)
    return config


def _read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise UsageError(f"{folder} is not an HF model directory (no config.json)")
    try:
        return load_config(folder)
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path}: not a usable model config ({type(exc).__name__}: {exc})") from None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"{index}: unreadable index ({type(exc).__name__}: {exc})") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise UsageError(f"{index}: names weight files that do not exist: {missing[:3]}")
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise UsageError(f"{folder}: no model.safetensors (or model.safetensors.index.json)")
    return [single]


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header; UsageError if the file is truncated or corrupt."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UsageError(f"{path}: corrupt safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise UsageError(f"{path}: corrupt safetensors file (header length {length} exceeds the file)")
        try:
            header = json.loads(fh.read(length))
        except (ValueError, UnicodeDecodeError):
            raise UsageError(f"{path}: corrupt safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise UsageError(f"{path}: corrupt safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    try:
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
        shapes = {name: tuple(int(d) for d in t["shape"]) for name, t in header.items()}
    except (KeyError, TypeError, ValueError, IndexError):
        raise UsageError(f"{path}: corrupt safetensors file (malformed tensor entry)") from None
    if 8 + length + end != size:
        raise UsageError(
            f"{path}: truncated or corrupt ({size} bytes, its header describes {8 + length + end})"
        )
    return shapes


def _check_shapes(folder: Path, config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    expected = expected_shapes(config)
    if config.tie_word_embeddings:
        shapes.pop(TIED_HEAD_NAME, None)
    unknown = sorted(set(shapes) - set(expected))
    if unknown:
        raise UsageError(f"{folder}: weights unknown to a {config.model_type} model: {unknown[:3]}")
    for name, shape in shapes.items():
        if shape != expected[name]:
            raise UsageError(
                f"{folder}: weight {name} has shape {shape}, config.json implies {expected[name]}"
            )
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise UsageError(f"{folder}: missing weights {missing[:3]} ({len(missing)} in all)")


def check_tokenizer(folder: Path, config: ModelConfig) -> None:
    """The tokenizer parses and produces only ids that the model's embedding has rows for."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"{folder}: no tokenizer.json")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust parser raises plain Exception
        raise UsageError(f"{path}: unreadable tokenizer ({str(exc).splitlines()[0][:120]})") from None
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= config.vocab_size:
        raise UsageError(
            f"{path}: tokenizer does not match the model: token id {largest} but config.json vocab_size "
            f"is {config.vocab_size}"
        )
