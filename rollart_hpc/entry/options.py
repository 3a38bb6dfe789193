"""Arguments that several commands take alike."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

RUN_CONFIG_HELP = "TOML run config (see configs/)"


def add_config_arguments(
    parser: argparse.ArgumentParser, overrides_help: str, config_help: str = RUN_CONFIG_HELP
) -> None:
    """The positional CONFIG and its dotted `key=value` overrides (those written after options are
    collected by `rollart_hpc.entry.cli.main`)."""
    parser.add_argument("config", help=config_help)
    parser.add_argument("overrides", nargs="*", help=overrides_help)


def add_run_dir_argument(parser: argparse.ArgumentParser) -> None:
    """`--run-dir`, by default a new `runs/<run.name>-<timestamp>` (`resolve_run_dir`)."""
    parser.add_argument("--run-dir", help="run directory (default: runs/<run.name>-<timestamp>)")


def resolve_run_dir(args: argparse.Namespace, run_name: str) -> Path:
    """The absolute `--run-dir`, or `runs/<run_name>-<YYYYmmdd-HHMMSS>` when it is not given."""
    return Path(args.run_dir or f"runs/{run_name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
