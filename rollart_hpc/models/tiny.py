"""Tiny random Llama/Qwen2/Qwen3 decoders with a small byte-level BPE tokenizer, saved in HF layout.

Deterministic: the same arguments (and the same corpus, in the same order) give byte-identical
tokenizer files and identical weights. Every parameter is drawn from one seeded generator in sorted
name order, independent of transformers' own init. Biases and norm weights are drawn too (not left at
0/1) so that every code path of a forward pass is exercised by parity tests.

The directory holds config.json, generation_config.json, model.safetensors and tokenizer files, and
loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` and with
`rollart_hpc.models.checkpoint.load_checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_hpc.models.config import FAMILY_ARCHITECTURE, config_from_dict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

FAMILIES = ("llama", "qwen2", "qwen3")
PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEFAULT_CORPUS = (
    "You are in a kitchen. There is a fridge, a table and a door to the north.",
    "> open fridge\nYou open the fridge. Inside you see an apple, a carrot and some milk.",
    "> take apple\nYou take the apple from the fridge.",
    "> go north\nYou are in a corridor. Exits: south, east.",
    "What is 12 + 30? The answer is 42. What is 7 * 8? The answer is 56.",
    "Compute 123 - 45 = 78. Compute 9 * 9 = 81. Compute 100 / 4 = 25.",
    "The frozen lake: move left, right, up or down to reach the goal without falling into a hole.",
    "Please think step by step and give the final answer at the end.",
    "Hello! How can I help you today? Thank you, goodbye.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) . , ; : ! ? ' \"",
)


def make_tiny_tokenizer(
    corpus: Iterable[str] | None = None, vocab_size: int = 512
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (all 256 bytes + merges + 3 ChatML specials) on `corpus`.

    The vocabulary has at most `vocab_size` entries (fewer when the corpus has too few merges).

    eos is `<|im_end|>` (ends an assistant turn), pad is `<|endoftext|>`; no BOS is prepended.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(DEFAULT_CORPUS if corpus is None else corpus)
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE, got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def tiny_config(
    family: str,
    vocab_size: int,
    eos_token_id: int,
    pad_token_id: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None = None,
) -> Any:
    """The HF config (LlamaConfig, Qwen2Config or Qwen3Config) of a tiny model; `rope_scaling` adds
    RoPE scaling parameters (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) to `rope_parameters`."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if head_dim < 64:
        raise ValueError(f"head_dim must be >= 64 (vLLM's CPU attention needs it), got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    fields: dict[str, Any] = {
        "architectures": [FAMILY_ARCHITECTURE[family]],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta},
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    config = cls(**fields)
    config_from_dict(config.to_dict())  # ValueError for what the engines and the trainer do not support
    return config


def _init_parameters(model: Any, seed: int, std: float) -> None:
    """Deterministic init: one generator, parameters in sorted name order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(noise + base)


def make_tiny_model(
    out_dir: str | Path,
    family: str = "llama",
    seed: int = 0,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
    init_std: float = 0.02,
    corpus: Iterable[str] | None = None,
    rope_scaling: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random `family` model with its tokenizer to `out_dir` (fp32 safetensors); return the path.

    The defaults give about 3 M parameters. The tokenizer is trained on `corpus` (default: a small
    built-in sample of game and arithmetic text). `head_dim` is independent of hidden_size / num_heads
    (Qwen3 sizes differ, e.g. 1024 / 16 heads of 128); `rope_scaling`: see `tiny_config`.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    tokenizer = make_tiny_tokenizer(corpus, vocab_size=vocab_size)
    config = tiny_config(
        family,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_parameters(model, seed, init_std)
    if tie_word_embeddings:
        model.tie_weights()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar in a run's console
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    return out


# Files of a complete model directory.
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# A cache entry's checksums of its files (`sha256sum -c` reads it); an entry whose files differ is built again.
MANIFEST = "files.sha256"
# Packages whose versions shape the written files (tokenizer training, weight init, serialisation).
KEY_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
# Entries the cache keeps: the most recently used (a tiny model of the default shape is about 0.4 MB).
CACHE_ENTRIES = 64


def default_cache_dir() -> Path:
    """`$ROLLART_HPC_CACHE`, else `$XDG_CACHE_HOME/rollart_hpc`, else `~/.cache/rollart_hpc`."""
    if os.environ.get("ROLLART_HPC_CACHE"):
        return Path(os.environ["ROLLART_HPC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollart_hpc"


def tiny_model_key(corpus: Iterable[str] | None, **kwargs: Any) -> str:
    """What decides `make_tiny_model`'s files: its arguments, the corpus in order, this module's source
    and the versions of the packages that write them."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps(kwargs, sort_keys=True, default=repr).encode())
    h.update(json.dumps({name: metadata.version(name) for name in KEY_PACKAGES}).encode())
    for text in DEFAULT_CORPUS if corpus is None else corpus:
        h.update(len(text.encode()).to_bytes(8, "little") + text.encode())
    return h.hexdigest()[:32]


def cached_tiny_model(
    out_dir: str | Path, cache_dir: Path | None = None, corpus: Iterable[str] | None = None, **kwargs: Any
) -> Path:
    """`make_tiny_model(out_dir, corpus=corpus, **kwargs)`, copied from `cache_dir/tiny-models/KEY` when an
    earlier call built the same files (`tiny_model_key`); a miss builds there first (temp dir, rename, so
    concurrent builders of one key leave one complete copy). The copy is checked against the entry's
    checksums (`MANIFEST`); an entry with a lost, truncated or altered file is built again. Building takes
    seconds of CPU (transformers' model classes, tokenizer training); a copy, milliseconds."""
    texts = None if corpus is None else list(corpus)
    entry = (cache_dir or default_cache_dir()) / "tiny-models" / tiny_model_key(texts, **kwargs)
    out = Path(out_dir)
    if out.exists():  # copies go to a new directory; an existing one is written as make_tiny_model does
        return make_tiny_model(out, corpus=texts, **kwargs)
    try:
        for _ in range(2):  # a second try after a damaged entry, rebuilt by the first
            _fill(entry, texts, kwargs)
            os.utime(entry)  # used now: the last to be evicted
            shutil.copytree(entry, out, ignore=shutil.ignore_patterns(MANIFEST))
            if _checksums(out) == _manifest(entry):
                return out
            shutil.rmtree(out)
            _discard(entry)
    except OSError:  # no writable cache (a read-only home on a compute node): build in place
        shutil.rmtree(out, ignore_errors=True)  # a partial copy, made by this call
    return make_tiny_model(out, corpus=texts, **kwargs)


def _checksums(model_dir: Path) -> dict[str, str]:
    """sha256 of every file of `model_dir` but the manifest."""
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(model_dir.iterdir())
        if path.is_file() and path.name != MANIFEST
    }


def _manifest(entry: Path) -> dict[str, str] | None:
    """The checksums an entry recorded when it was built (`sha256sum` lines); None when the manifest is
    missing, unreadable or lacks one of `MODEL_FILES`."""
    try:
        lines = (entry / MANIFEST).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    sums = {}
    for line in lines:
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            return None
        sums[name] = digest
    return sums if set(MODEL_FILES) <= set(sums) else None


def _discard(entry: Path) -> None:
    """Move a damaged entry aside and remove it, so no reader copies it half deleted."""
    trash = entry.with_name(f".discard-{entry.name}-{os.getpid()}")
    try:
        entry.rename(trash)
    except OSError:  # gone already, or replaced by another process
        return
    shutil.rmtree(trash, ignore_errors=True)


def _fill(entry: Path, texts: list[str] | None, kwargs: dict[str, Any]) -> None:
    if _manifest(entry) is None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=entry.parent))
        try:
            model = make_tiny_model(scratch / "model", corpus=texts, **kwargs)
            lines = (f"{digest}  {name}\n" for name, digest in _checksums(model).items())
            (model / MANIFEST).write_text("".join(lines))
            _discard(entry)  # incomplete: a copy without its manifest
            try:
                model.rename(entry)
            except OSError:  # another builder renamed its complete copy first
                if _manifest(entry) is None:
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        _evict(entry.parent, keep=entry)


def _evict(root: Path, keep: Path) -> None:
    """Remove the least recently used entries of `root` beyond `CACHE_ENTRIES`."""
    entries = []
    for path in root.iterdir():
        try:
            entries.append((path.stat().st_mtime, path))
        except OSError:  # removed meanwhile by another process
            continue
    entries = [e for e in entries if not e[1].name.startswith(".") and e[1] != keep]
    for _, path in sorted(entries, reverse=True)[CACHE_ENTRIES - 1 :]:
        shutil.rmtree(path, ignore_errors=True)
