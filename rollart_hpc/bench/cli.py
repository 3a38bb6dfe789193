"""`launch.py bench NAME ...`: benchmarks that write JSON. Registry of benchmark modules, each with
`add_arguments(parser)` and `main(args)`; imported only when chosen, so `--help` stays fast."""

from __future__ import annotations

import argparse

from rollart_hpc.config.commands import Registry, add_subcommands, run_subcommand

BENCHMARKS: Registry = {
    "engine": ("rollart_hpc.bench.engine", "built-in engine vs HF generate tokens/s (JSON)"),
    "kernel": ("rollart_hpc.bench.kernel", "fused LM-head log-prob + SPO++ loss vs eager (JSON)"),
    "weights": ("rollart_hpc.bench.weights", "weight sync: bucketed publish vs raw broadcast (JSON)"),
    "controller": ("rollart_hpc.bench.controller", "controller bookkeeping rate and 10k in flight (JSON)"),
    "e2e": ("rollart_hpc.bench.e2e", "sync vs one_step_off vs async runs: time to target, throughput (JSON)"),
    "affinity": (
        "rollart_hpc.bench.affinity",
        "rollout pools of unequal hardware: hash vs static vs adaptive routing, with and without redundancy (JSON)",
    ),
    "activations": (
        "rollart_hpc.bench.activations",
        "trainer forward+backward: attention sdpa/unfused x recompute none/selective/full, peak memory and time (JSON)",
    ),
    "reward": (
        "rollart_hpc.bench.reward",
        "dedicated reward workers vs one shared elastic reward service (JSON)",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_subcommands(parser, BENCHMARKS, dest="bench", metavar="NAME", module_attr="_bench")


def main(args: argparse.Namespace) -> int:
    return run_subcommand(args, "_bench")
