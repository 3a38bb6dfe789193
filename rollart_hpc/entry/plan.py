"""`launch.py plan CONFIG [key=value ...] [--memory [--json OUT]]`: the run plan of a config, resolved as for
`run`: every rank's role (and, with `--memory`, the GPU memory it needs, `rollart_hpc.plan.ranks`). A memory
plan that cannot fit is a usage error (exit 2) naming the rank, its total, its limit and its biggest term."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.tensor_parallel=2")
    parser.add_argument(
        "--memory", action="store_true", help="every rank's GPU memory by term; exit 2 when a rank cannot fit"
    )
    parser.add_argument("--json", metavar="OUT", help="with --memory: write the memory plan as JSON to OUT")


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.config import load_config
    from rollart_hpc.contracts.errors import UsageError
    from rollart_hpc.plan.ranks import memory_plan

    if args.json and not args.memory:
        raise UsageError("--json writes the memory plan: add --memory")
    config = load_config(args.config, args.overrides)
    print(make_plan(config.roles).table())
    if args.memory:
        memory = memory_plan(config)
        print(memory.table())
        if args.json:
            memory.write_json(args.json)
        memory.check()
    return 0
