"""The registry of environment families, keyed by family name, and the picklable spec that builds one.

A family knows its canonical tasks, makes env instances and holds the oracle (the action texts that
solve a task, written as the agent would write them). Every family is named by import path: the
built-in ones in `BUILTIN_FAMILIES` (a factory and a reward function each; adding a family is its module
plus one entry here and its name in `rollart_hpc.config.choices.FAMILY_NAMES`), a run's own ones in
`envs.plugins` / `envs.datasets` (`rollart_hpc.tasks.build`). A `FamilySpec` (name, factory path, keyword
options, the directories its module is imported from) is what child processes receive to build the same
family; equal specs build equal families.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rollart_hpc.tasks.plugins import load_callable
from rollart_hpc.tasks.rewards import ENV_WON
from rollart_hpc.tasks.types import Env, Task


class Family(Protocol):
    """A set of tasks of one kind and the envs that play them (see `rollart_hpc.api` for the contract).

    `name` prefixes every task id ("name/rest"); `tasks()` are the training tasks, `heldout_tasks(n)` up
    to `n` evaluation tasks never in `tasks()`; `task(id)` any of either; `make_env()` a fresh env that
    can play any of them; `oracle(id)` the replies that win task `id`, in order.
    """

    name: str

    def tasks(self) -> list[Task]: ...

    def heldout_tasks(self, count: int) -> list[Task]: ...

    def task(self, tid: str) -> Task: ...

    def make_env(self) -> Env: ...

    def oracle(self, tid: str) -> list[str]: ...


@dataclass(frozen=True)
class FamilyEntry:
    """A registered family: the import path of its factory (`**options -> Family`) and of its reward
    function (`RewardInput -> RewardOutput`)."""

    factory: str
    reward: str = ENV_WON


BUILTIN_FAMILIES: dict[str, FamilyEntry] = {
    "household": FamilyEntry("rollart_hpc.tasks.families.household:HouseholdFamily"),
    "calc_math": FamilyEntry(
        "rollart_hpc.tasks.families.calc_math:CalcMathFamily", "rollart_hpc.tasks.families.calc_math:score"
    ),
    "frozenlake": FamilyEntry("rollart_hpc.tasks.families.frozenlake:FrozenLakeFamily"),
}
"""One entry per name in `rollart_hpc.config.choices.FAMILY_NAMES` (tests/test_config.py checks that the
two agree)."""


def _constructor(name: str) -> Callable[..., Family]:
    def make(**options: Any) -> Family:
        return load_callable(BUILTIN_FAMILIES[name].factory)(**options)  # type: ignore[no-any-return]

    return make


FAMILIES: dict[str, Callable[..., Family]] = {name: _constructor(name) for name in BUILTIN_FAMILIES}
"""The built-in families' constructors, by name."""


@dataclass(frozen=True)
class FamilySpec:
    """A family name, its factory's import path ('' = the built-in family of that name), the factory's
    keyword options (e.g. calc_math `max_ops`) and the directories its module is imported from; hashable
    (options may hold lists and tables, as a config writes them)."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    factory: str = ""
    python_path: tuple[str, ...] = ()

    @classmethod
    def of(cls, name: str, **options: Any) -> FamilySpec:
        return cls(name, tuple(sorted(options.items())))

    def __hash__(self) -> int:
        return hash((self.name, repr(self.options), self.factory, self.python_path))

    def build(self) -> Family:
        if not self.factory:
            return make_family(self.name, **dict(self.options))
        return load_callable(self.factory, self.python_path)(**dict(self.options))  # type: ignore[no-any-return]


def make_family(name: str, **options: Any) -> Family:
    if name not in FAMILIES:
        raise KeyError(f"unknown env family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name](**options)


def family_of(task_id: str) -> str:
    """The family name encoded in a task id ("family/rest")."""
    name = task_id.partition("/")[0]
    if name not in FAMILIES:
        raise KeyError(f"task id {task_id!r} names no known family")
    return name
