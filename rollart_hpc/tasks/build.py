"""The run's env families and tasks, built from the `envs` sub-config of the run config.

Built-in families come from `rollart_hpc.tasks.registry`, the run's own from `envs.plugins` (a factory by
import path, with its options) and `envs.datasets` (`rollart_hpc.tasks.families.dataset`).

Training tasks (`run_tasks`: what the warm start and the task sampler see) and held-out tasks
(`heldout_tasks`: evaluation only) are disjoint by construction: each family's `tasks()` never holds
one of its `heldout_tasks(n)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rollart_hpc.config.schema import EnvsConfig
from rollart_hpc.tasks.registry import FamilySpec
from rollart_hpc.tasks.rewards import AGENT_RETURN, ENV_WON
from rollart_hpc.tasks.types import Task

DATASET_FACTORY = "rollart_hpc.tasks.families.dataset:DatasetFamily"


def family_specs(envs: EnvsConfig, python_path: Sequence[str] = ()) -> dict[str, FamilySpec]:
    """One `FamilySpec` per configured family, with that family's options from the config; the specs of
    envs.plugins carry `python_path` (run.python_path), so child processes import their modules."""
    own = {
        p.name: FamilySpec(p.name, _frozen(p.options), p.factory, tuple(python_path)) for p in envs.plugins
    }
    for d in envs.datasets:
        own[d.name] = FamilySpec(d.name, _frozen(dataclasses.asdict(d)), DATASET_FACTORY)
    options: dict[str, dict[str, Any]] = {"calc_math": {"max_ops": envs.calc_max_ops}}
    household: dict[str, Any] = {}
    if envs.household_types:
        household["types"] = tuple(envs.household_types)
    if envs.household_numbered:
        household["numbered"] = True
    if household:
        options["household"] = household
    return {name: own.get(name) or FamilySpec.of(name, **options.get(name, {})) for name in envs.families}


def _frozen(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(options.items()))


def run_tasks(envs: EnvsConfig) -> list[Task]:
    """The run's tasks: for each family, its first `num_tasks[family]` tasks (all when absent)."""
    tasks = []
    for name, spec in family_specs(envs).items():
        family_tasks = spec.build().tasks()
        tasks.extend(family_tasks[: envs.num_tasks.get(name, len(family_tasks))])
    return tasks


def heldout_tasks(envs: EnvsConfig) -> list[Task]:
    """The run's held-out evaluation tasks: for each family, its first `envs.heldout_count(family)`."""
    tasks = []
    for name, spec in family_specs(envs).items():
        count = envs.heldout_count(name)
        if count:
            tasks.extend(spec.build().heldout_tasks(count))
    return tasks


def playable_tasks(envs: EnvsConfig, heldout: bool) -> dict[str, Task]:
    """Every task an env rank may be dispatched, by id: each family's tasks, plus the held-out ones when
    the world evaluates (`heldout`; the held-out household games are only read then)."""
    tasks = {t.id: t for spec in family_specs(envs).values() for t in spec.build().tasks()}
    tasks.update((t.id, t) for t in (heldout_tasks(envs) if heldout else []))
    return tasks


def own_family_rewards(envs: EnvsConfig) -> dict[str, str]:
    """The registered reward function of each envs.plugins / envs.datasets family (the env's verdict); in
    a run with its own agent (`envs.agent`), every family's is the agent's return (`agent_return`).
    `reward.functions` entries take precedence over these."""
    if envs.agent:
        return dict.fromkeys(envs.families, AGENT_RETURN)
    return dict.fromkeys(envs.own_families, ENV_WON)
