"""Command line: one registry of subcommands, each a module with `add_arguments(parser)` and `main(args)`.

Subcommand modules must be cheap to import (no torch, MPI or megatron at module level) so that
`--help` stays fast; they import the heavy stack inside `main`. A `UsageError` raised anywhere below
becomes a one-line message on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rollart_hpc.config.commands import Registry, add_subcommands, run_subcommand
from rollart_hpc.contracts.errors import UsageError

# name -> (module, one-line help). Explicit; no import-time discovery.
COMMANDS: Registry = {
    "run": ("rollart_hpc.entry.launcher", "run a config locally as one MPI world (mpiexec)"),
    "resume": ("rollart_hpc.entry.resume", "restart a local run from its last checkpoint"),
    "eval": ("rollart_hpc.entry.evaluate", "evaluate a run's checkpoint on its tasks and held-out tasks"),
    "submit": (
        "rollart_hpc.entry.submit",
        "submit a config to SLURM (hetjob across partitions, else submitit)",
    ),
    "plan": (
        "rollart_hpc.entry.plan",
        "the run plan of a config: every rank's role, --memory its GPU memory",
    ),
    "sweep": ("rollart_hpc.entry.sweep", "a grid of runs over seeds, locally or as one SLURM job array"),
    "compare": ("rollart_hpc.entry.compare", "curves and bootstrap intervals of a sweep's arms"),
    "simulate": (
        "rollart_hpc.entry.simulate",
        "calibrate the scale simulator on a run, validate it, project sizes",
    ),
    "chaos": ("rollart_hpc.entry.chaos", "inject faults into local runs and check their recovery"),
    "bench": ("rollart_hpc.bench.cli", "benchmarks that write JSON"),
    "reward-service": (
        "rollart_hpc.entry.reward_service",
        "a standalone elastic reward service for many runs",
    ),
    "report": ("rollart_hpc.metrics.report", "plots and a markdown summary of a run directory"),
    "model": ("rollart_hpc.models.cli", "import or create policy models"),
    "envs": ("rollart_hpc.envs.cli", "prepare, check or play environment tasks"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch.py",
        description="rollart_hpc: asynchronous, disaggregated agentic RL on one box or SLURM",
    )
    add_subcommands(parser, COMMANDS, dest="command", metavar="COMMAND", module_attr="_module")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Dotted overrides may follow options (`run CFG --run-dir D a.b=1`); argparse stops the positional
    # list at the first option, so collect the rest here for commands that take overrides.
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return run_subcommand(args, "_module")
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
