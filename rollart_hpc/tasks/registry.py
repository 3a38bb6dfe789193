"""The registry of environment families, keyed by family name.

A family knows its canonical tasks, makes env instances and holds the oracle (the action texts that
solve a task, written as the agent would write them). A `FamilySpec` (name + keyword options) is the
picklable description that child processes use to build the same family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rollart_hpc.tasks.types import Env, Task


class Family(Protocol):
    name: str

    def tasks(self) -> list[Task]: ...

    def heldout_tasks(self, count: int) -> list[Task]: ...

    def task(self, tid: str) -> Task: ...

    def make_env(self) -> Env: ...

    def oracle(self, tid: str) -> list[str]: ...


def _household(**options: Any) -> Family:
    from rollart_hpc.tasks.families.household import HouseholdFamily

    return HouseholdFamily(**options)


def _calc_math(**options: Any) -> Family:
    from rollart_hpc.tasks.families.calc_math import CalcMathFamily

    return CalcMathFamily(**options)


def _frozenlake(**options: Any) -> Family:
    from rollart_hpc.tasks.families.frozenlake import FrozenLakeFamily

    return FrozenLakeFamily(**options)


# One constructor per name in `rollart_hpc.config.choices.FAMILY_NAMES`, the home of the family names
# (tests/test_config.py checks that the two agree).
FAMILIES: dict[str, Callable[..., Family]] = {
    "household": _household,
    "calc_math": _calc_math,
    "frozenlake": _frozenlake,
}


@dataclass(frozen=True)
class FamilySpec:
    """A family name plus the keyword options of its constructor (e.g. calc_math `max_ops`), hashable."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str, **options: Any) -> FamilySpec:
        return cls(name, tuple(sorted(options.items())))

    def build(self) -> Family:
        return make_family(self.name, **dict(self.options))


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
