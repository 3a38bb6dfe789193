"""The evaluation job (`run.job = "eval"`, written by `launch.py eval`): the RL job's roles, with the
controller's main replaced by the one that only evaluates (`controller.eval_main`)."""

from __future__ import annotations

from pathlib import Path

from rollart_hpc.cluster.world import World
from rollart_hpc.config.schema import Config
from rollart_hpc.entry.rl import ROLE_MAINS, run_roles

EVAL_ROLE_MAINS: dict[str, str] = {**ROLE_MAINS, "controller": "rollart_hpc.controller.eval_main"}


def main(config: Config, world: World, run_dir: Path) -> None:
    run_roles(config, world, run_dir, EVAL_ROLE_MAINS)
