"""The shape of a tiny random model, as `models.tiny.make_tiny_model` takes it, read off a config section
or parsed arguments that name these fields alike."""

from __future__ import annotations

from typing import Any

SHAPE_FIELDS = ("family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size")


def tiny_shape(source: Any) -> dict[str, Any]:
    """`make_tiny_model`'s shape keywords (`SHAPE_FIELDS`) from the attributes of `source`."""
    return {name: getattr(source, name) for name in SHAPE_FIELDS}
