"""The RL job (`run.job = "rl"`): every rank builds its RunContext and enters its role's main. See
`rollart_hpc.cluster.context` for the start-up order and the controller, rollout, env, reward and train
packages for each role's loop."""

from __future__ import annotations

import importlib
from pathlib import Path

from rollart_hpc.cluster import signals
from rollart_hpc.cluster.context import RunContext
from rollart_hpc.cluster.mailbox import Mailbox
from rollart_hpc.cluster.world import World
from rollart_hpc.config.schema import Config
from rollart_hpc.metrics.log import rank_logger

# role -> module with `main(config, ctx, run_dir)`; explicit.
ROLE_MAINS: dict[str, str] = {
    "controller": "rollart_hpc.controller.main",
    "rollout": "rollart_hpc.rollout.main",
    "env": "rollart_hpc.envs.main",
    "reward": "rollart_hpc.reward.main",
    "trainer": "rollart_hpc.train.main",
}


def main(config: Config, world: World, run_dir: Path) -> None:
    run_roles(config, world, run_dir, ROLE_MAINS)


def run_roles(config: Config, world: World, run_dir: Path, role_mains: dict[str, str]) -> None:
    """Build this rank's RunContext and enter its role's main (a module of `role_mains`)."""
    log = rank_logger(world.role, world.rank, run_dir)
    signals.install()  # idempotent; the worker entry installs it first thing (see cluster/signals.py)
    signals.install_sigterm(config.cluster.sigterm_grace_s)
    watch = range(world.plan.world_size) if world.rank == 0 else [0]
    mailbox = Mailbox(world, watch, config.controller.heartbeat_s)
    ctx = RunContext(config, world, run_dir, log, mailbox)
    try:
        importlib.import_module(role_mains[world.role]).main(config, ctx, run_dir)
        log.info(f"{world.role} rank {world.rank} done")
    finally:
        mailbox.close()
