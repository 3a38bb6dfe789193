"""The checks of a run's own code and data, made when a run starts (before its run directory is written).

`check_own_code` imports every envs.plugins factory and reward.functions entry and the envs.agent function, builds each plug-in family
and holds it to the `Family` contract (methods, name, tasks, an env with reset/step/close), and reads every
envs.datasets file. Each problem is a `UsageError` of one line naming the config key; what passes comes
back as summary lines (one per dataset: its tasks and malformed rows).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from rollart_hpc.config.schema import DatasetConfig, EnvsConfig, RewardConfig
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.tasks.families.dataset import DatasetError, read_rows
from rollart_hpc.tasks.plugins import PluginError, add_python_path, load_callable
from rollart_hpc.tasks.types import Task

FAMILY_METHODS = ("tasks", "heldout_tasks", "task", "make_env", "oracle")
ENV_METHODS = ("reset", "step", "close")


def check_own_code(envs: EnvsConfig, reward: RewardConfig, python_path: Sequence[str]) -> list[str]:
    """Check the run's plug-ins and datasets (see the module docstring); the datasets' summary lines."""
    add_python_path(python_path)
    for index, plugin in enumerate(envs.plugins):
        check_family(f"envs.plugins[{index}]", plugin.name, plugin.factory, plugin.options)
    for family, path in reward.functions.items():
        check_reward_fn(f"reward.functions.{family}", path)
    if envs.agent:
        check_agent("envs.agent", envs.agent)
    return [dataset_summary(f"envs.datasets[{i}]", d) for i, d in enumerate(envs.datasets)]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _load(key: str, path: str) -> Any:
    try:
        return load_callable(path)
    except PluginError as exc:
        raise UsageError(f"{key}: {exc}") from None


def check_family(key: str, name: str, factory: str, options: dict[str, Any]) -> None:
    """Build the family `factory(**options)` and hold it to the Family contract."""
    make = _load(f"{key}.factory", factory)
    try:
        family = make(**options)
    except Exception as exc:  # the user's factory: any failure is reported as one line
        raise UsageError(f"{key}.options: {factory}(**options) raised {_one_line(exc)}") from None
    what = f"{key}.factory: {factory!r} made a {type(family).__name__}"
    missing = [m for m in FAMILY_METHODS if not callable(getattr(family, m, None))]
    if missing:
        raise UsageError(f"{what} without {', '.join(missing)} (see rollart_hpc.api.Family)")
    if getattr(family, "name", None) != name:
        raise UsageError(f"{what} named {getattr(family, 'name', None)!r}, not {name!r} ({key}.name)")
    try:
        _check_tasks(name, family.tasks())
        env = family.make_env()
        missing = [m for m in ENV_METHODS if not callable(getattr(env, m, None))]
        if not missing:
            env.close()
    except UsageError as exc:
        raise UsageError(f"{what} whose {exc}") from None
    except Exception as exc:  # the user's family: any failure is reported as one line
        raise UsageError(f"{what} that raised {_one_line(exc)}") from None
    if missing:
        raise UsageError(f"{what} whose make_env() gave an env without {', '.join(missing)}")


def _check_tasks(name: str, tasks: Any) -> None:
    if not isinstance(tasks, list) or not tasks:
        raise UsageError("tasks() is not a non-empty list of rollart_hpc.api.Task")
    for task in tasks:
        if not isinstance(task, Task):
            raise UsageError(f"tasks() holds a {type(task).__name__}, not a rollart_hpc.api.Task")
        if task.family != name or not task.id.startswith(f"{name}/"):
            raise UsageError(f"task {task.id!r} is not of family {name!r} (its id must start with '{name}/')")


def check_reward_fn(key: str, path: str) -> None:
    """The function must take one argument (a RewardInput)."""
    fn = _load(key, path)
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise UsageError(f"{key}: {path!r} does not take one argument (a RewardInput)") from None
    except ValueError:  # no signature to read (a builtin): called as is
        pass


def check_agent(key: str, path: str) -> None:
    """The agent must be an async function taking two arguments (an openai.AsyncOpenAI client, a Task)."""
    fn = _load(key, path)
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)):
        raise UsageError(f"{key}: {path!r} is not an async function (async def run(client, task))")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise UsageError(f"{key}: {path!r} does not take two arguments (client, task)") from None
    except ValueError:  # no signature to read: called as is
        pass


def dataset_summary(key: str, dataset: DatasetConfig) -> str:
    """The summary line of one task file (its tasks and malformed rows); an unreadable one is an error."""
    try:
        rows = read_rows(
            dataset.path,
            dataset.prompt_field,
            dataset.answer_field,
            dataset.split_field,
            dataset.heldout_fraction,
        )
    except DatasetError as exc:
        raise UsageError(f"{key}.path: {exc}") from None
    return rows.summary(dataset.name)
