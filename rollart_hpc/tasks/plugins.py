"""Objects named by import path ("package.module:attribute"): the plug-in families and reward functions.

`load_object(path, python_path)` puts the directories of `python_path` first on `sys.path` (once each),
imports the module and follows the dotted attribute. Every failure is a `PluginError` with one line
naming the path and what is wrong; the config checks (`rollart_hpc.tasks.checks`) turn it into a
`UsageError` naming the config key. Nothing is imported until asked for.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import Any

from rollart_hpc.config.schema import IMPORT_PATH


class PluginError(Exception):
    """An import path that does not name a usable object (one line)."""


def add_python_path(dirs: Iterable[str]) -> None:
    """Put each directory first on `sys.path` unless it is already there."""
    for folder in reversed(list(dirs)):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def split_path(path: str) -> tuple[str, str]:
    """'pkg.mod:attr.sub' -> ('pkg.mod', 'attr.sub'); anything else is a PluginError."""
    if not IMPORT_PATH.fullmatch(path):
        raise PluginError(f"{path!r} is not an import path of the form 'package.module:attribute'")
    module, _, attr = path.partition(":")
    return module, attr


def load_object(path: str, python_path: Iterable[str] = ()) -> Any:
    """The object that `path` names (see the module docstring)."""
    module_name, attr = split_path(path)
    add_python_path(python_path)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # a user's module: any import failure is reported as one line
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise PluginError(f"{path!r}: cannot import {module_name!r}: {type(exc).__name__}: {first}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_callable(path: str, python_path: Iterable[str] = ()) -> Any:
    """`load_object`, and the object must be callable."""
    obj = load_object(path, python_path)
    if not callable(obj):
        raise PluginError(f"{path!r} names a {type(obj).__name__}, not a callable")
    return obj
