"""What every rank of an RL run shares: its context (config, world, mailbox, run directory, log).

Start-up order (no deadlock, every wait bounded):
1. the first trainer and every rollout rank form the weights group (their role mains do it first thing);
   trainer ranks form the torch.distributed default group among themselves (Megatron's data-parallel
   world);
2. controller: prepares the initial model (`model/init`) and sends START to the trainers;
3. trainers: build the model, warm-start on oracle demonstrations, save `model/warm`, send READY;
4. controller: sends START (the warm model) to rollout, env and reward ranks; they load it and send READY;
5. the first trainer builds the weight publisher (a collective with the rollout ranks' receivers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollart_hpc.cluster.mailbox import Mailbox
from rollart_hpc.cluster.world import World
from rollart_hpc.config.schema import ClusterConfig, Config


@dataclass
class RunContext:
    config: Config
    world: World
    run_dir: Path
    log: logging.Logger
    mailbox: Mailbox

    @property
    def ranks(self) -> dict[str, list[int]]:
        plan = self.world.plan
        return {r.role: list(r.ranks) for r in plan.roles}

    @property
    def weight_members(self) -> list[int]:
        """World ranks of the weights group, in member order: the first trainer (member 0), then rollouts."""
        return [self.ranks["trainer"][0], *self.ranks["rollout"]]


def torch_backend(cluster: ClusterConfig) -> Literal["gloo", "nccl"]:
    """The torch.distributed backend of the run's groups (`cluster.torch_backend`, "auto" resolved)."""
    from rollart_hpc.cluster.torchdist import pick_backend  # torch

    return "nccl" if pick_backend(cluster.torch_backend) == "nccl" else "gloo"
