"""What every rank of an RL run shares: its context (world, mailbox, groups, model directory) and the
conversions from the run config to the libraries' own configs.

Start-up order (no deadlock, every wait bounded):
1. all ranks: the weights group (first trainer + every rollout rank) forms; trainer ranks form the
   torch.distributed default group among themselves (Megatron's data-parallel world);
2. controller: prepares the initial model (`model/init`) and sends START to the trainers;
3. trainers: build the model, warm-start on oracle demonstrations, save `model/warm`, send READY;
4. controller: sends START (the warm model) to rollout, env and reward ranks; they load it and send READY;
5. the first trainer builds the weight publisher (a collective with the rollout ranks' receivers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollart_hpc.cluster.mailbox import Mailbox
from rollart_hpc.cluster.world import World
from rollart_hpc.config.schema import Config


@dataclass
class RunContext:
    config: Config
    world: World
    run_dir: Path
    log: logging.Logger
    mailbox: Mailbox
    weights_group: Any = None

    @property
    def ranks(self) -> dict[str, list[int]]:
        plan = self.world.plan
        return {r.role: list(r.ranks) for r in plan.roles}

    @property
    def weight_members(self) -> list[int]:
        return [self.ranks["trainer"][0], *self.ranks["rollout"]]

    def make_weight_receiver(self) -> Any:
        from rollart_hpc.weights.publisher import WeightReceiver

        return WeightReceiver(self.weights_group, src_member=0)


def torch_backend(config: Config) -> Literal["gloo", "nccl"]:
    from rollart_hpc.cluster.torchdist import pick_backend

    return "nccl" if pick_backend(config.cluster.torch_backend) == "nccl" else "gloo"


def agent_config(config: Config) -> Any:
    from rollart_hpc.envs.agent_loop import AgentConfig

    r = config.rollout
    return AgentConfig(
        max_context_tokens=r.max_model_len,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
    )


def family_specs(config: Config) -> dict[str, Any]:
    from rollart_hpc.envs.registry import FamilySpec

    options: dict[str, dict[str, Any]] = {"calc_math": {"max_ops": config.envs.calc_max_ops}}
    household: dict[str, Any] = {}
    if config.envs.household_types:
        household["types"] = tuple(config.envs.household_types)
    if config.envs.household_numbered:
        household["numbered"] = True
    if household:
        options["household"] = household
    return {name: FamilySpec.of(name, **options.get(name, {})) for name in config.envs.families}


def run_tasks(config: Config) -> list[Any]:
    """The run's tasks: for each family, its first `num_tasks[family]` tasks (all when absent)."""
    tasks = []
    for name, spec in family_specs(config).items():
        family_tasks = spec.build().tasks()
        tasks.extend(family_tasks[: config.envs.num_tasks.get(name, len(family_tasks))])
    return tasks


def env_worker_config(config: Config) -> Any:
    from rollart_hpc.envs.faults import FaultConfig, LatencyConfig
    from rollart_hpc.envs.worker import EnvWorkerConfig

    e, f = config.envs, config.envs.faults
    faults = FaultConfig(
        seed=config.run.seed,
        crash_prob=f.crash_prob,
        hang_prob=f.hang_prob,
        error_prob=f.error_prob,
        latency=LatencyConfig(dist=f.latency, scale_s=f.latency_scale_s, max_s=f.latency_max_s),
    )
    return EnvWorkerConfig(
        num_slots=e.num_slots,
        step_timeout_s=e.step_timeout_s,
        episode_timeout_s=e.episode_timeout_s,
        faults=faults,
    )


def loss_config(config: Config) -> Any:
    from rollart_hpc.algo.loss import LossConfig

    a = config.algo
    return LossConfig(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip_c=a.dual_clip_c, is_cap=a.is_cap)
