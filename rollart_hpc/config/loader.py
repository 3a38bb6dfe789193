"""Typed config trees from TOML plus dotted overrides. Stdlib only (no torch, MPI or vLLM).

A config is a tree of frozen dataclasses. `build(cls, data)` turns a nested dict into that tree and
rejects, with a `UsageError` naming the dotted field, every unknown key, wrong type or value outside an
allowed set. Each field documents itself through `field(metadata={"doc": ...})` (see `doc_field`).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from rollart_hpc.contracts.errors import UsageError

T = TypeVar("T")


def doc_field(default: Any, doc: str) -> Any:
    """A dataclass field with a default and its documentation."""
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return dataclasses.field(default_factory=default, metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})


_BELOW_BOUND = {">=": lambda value, limit: value < limit, ">": lambda value, limit: value <= limit}


def check_bounds(settings: Any, path: str, **bounds: str) -> None:
    """Each named field of `settings` must meet its lower bound, written '>= N' or '> N'; the first field
    (in the order given) that does not is a one-line UsageError naming `path`.field, the bound and the
    value."""
    for name, bound in bounds.items():
        op, limit = bound.split()
        value = getattr(settings, name)
        if _BELOW_BOUND[op](value, float(limit)):
            raise UsageError(f"{path}.{name}: must be {bound}, got {value}")


def build(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build the dataclass `cls` from `data`, checking keys and types; `path` prefixes error names."""
    if not isinstance(data, Mapping):
        raise UsageError(f"{path or 'config'}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key, value in data.items():
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            raise UsageError(
                f"unknown key {_first_leaf(_join(path, key), value)} (allowed at this level: {allowed})"
            )
    kwargs = {key: _coerce(hints[key], value, _join(path, key)) for key, value in data.items()}
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{path or 'config'}: {exc}") from None
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)
    return obj


def _first_leaf(path: str, value: Any) -> str:
    """`trainer` with value {"lr": 1} -> `trainer.lr`: name what the user actually wrote."""
    while isinstance(value, Mapping) and len(value) == 1:
        key, value = next(iter(value.items()))
        path = f"{path}.{key}"
    return path


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)  # type: ignore[arg-type]
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise UsageError(f"{path}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (types.UnionType, typing.Union):
        return _coerce_union(tp, value, path)
    if origin in (list, tuple, Sequence):
        return _coerce_sequence(tp, value, path)
    if origin is dict:
        return _coerce_dict(tp, value, path)
    return _coerce_scalar(tp, value, path)


def _coerce_union(tp: Any, value: Any, path: str) -> Any:
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(arg, value, path)
        except UsageError as exc:
            errors.append(str(exc))
    raise UsageError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {tp}")


def _coerce_sequence(tp: Any, value: Any, path: str) -> Any:
    if not isinstance(value, list | tuple):
        raise UsageError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
    args = [a for a in get_args(tp) if a is not Ellipsis]
    item_tp = args[0] if args else Any
    items = [_coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if get_origin(tp) is tuple else items


def _coerce_dict(tp: Any, value: Any, path: str) -> Any:
    if not isinstance(value, Mapping):
        raise UsageError(f"{path}: expected a table, got {type(value).__name__}")
    key_tp, val_tp = get_args(tp) or (str, Any)
    return {str(k): _coerce(val_tp, v, f"{path}.{k}") for k, v in value.items()}


def _coerce_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise UsageError(f"{path}: expected int, got bool {value!r}")
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise UsageError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def load_toml(path: Path) -> dict[str, Any]:
    """Read a TOML file; a missing or malformed file is a one-line UsageError."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise UsageError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: invalid TOML: {exc}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.lr=1e-6` -> (["trainer", "lr"], 1e-06). Values are TOML; bare words are strings."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise UsageError(f"override {text!r} is not of the form dotted.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return [p.strip() for p in parts], value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set each `dotted.key=value` into a copy of the nested dict `data` (tables created as needed)."""
    out = _deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UsageError(f"override {text!r}: {'.'.join(parts[: i + 1])} is not a table")
            node = child
        node[parts[-1]] = value
    return out


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


def to_dict(obj: Any) -> Any:
    """A config tree as plain TOML-writable values (tuples become lists, None values are dropped)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            value = to_dict(getattr(obj, f.name))
            if value is not None:
                out[f.name] = value
        return out
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
