"""Subcommand registries shared by the command line and the benchmarks: name -> (module, one-line help),
each module with `add_arguments(parser)` and `main(args)`. A module is imported when the parser is built,
so it must be cheap to import (the heavy stack is imported inside its `main`)."""

from __future__ import annotations

import argparse
import importlib

Registry = dict[str, tuple[str, str]]


def add_subcommands(
    parser: argparse.ArgumentParser, registry: Registry, dest: str, metavar: str, module_attr: str
) -> None:
    """One required subparser per entry of `registry` (its help is also its description); the chosen
    module is set on the parsed arguments as `module_attr`."""
    sub = parser.add_subparsers(dest=dest, required=True, metavar=metavar)
    for name, (module_name, help_text) in registry.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(**{module_attr: module})


def run_subcommand(args: argparse.Namespace, module_attr: str) -> int:
    """The exit code of the chosen module's `main(args)` (None counts as 0)."""
    return int(getattr(args, module_attr).main(args) or 0)
