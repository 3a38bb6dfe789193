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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollart_hpc.cluster.mailbox import Mailbox
from rollart_hpc.cluster.placement import group_backend
from rollart_hpc.cluster.plan import RunPlan
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
        return {role: list(plan.ranks_of(role)) for role in dict.fromkeys(r.role for r in plan.roles)}

    @property
    def pools(self) -> dict[str, list[int]]:
        """Rollout pool name -> its world ranks."""
        return {name: list(ranks) for name, ranks in self.world.plan.pools().items()}

    @property
    def weight_members(self) -> list[int]:
        """World ranks of the weights group, in member order: the first trainer (member 0), then rollouts."""
        return [self.ranks["trainer"][0], *self.ranks["rollout"]]


def torch_backend(cluster: ClusterConfig, plan: RunPlan, members: Sequence[int]) -> Literal["gloo", "nccl"]:
    """The torch.distributed backend of a group of world ranks (`cluster.torch_backend`; "auto" is NCCL
    when every member has GPUs (`roles.<role>.gpus_per_rank`) and CUDA works here, else gloo)."""
    import torch

    return group_backend(cluster.torch_backend, plan, members, torch.cuda.is_available(), cluster.share_gpus)
