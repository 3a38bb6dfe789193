"""`trainer.sft_sampling`: how the warm start draws its demonstrations (by task, or family-balanced)."""

import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollart_hpc.config import load_config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.train.main import pick_demonstrations

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
DRAWS = 6000


def demos(counts: dict[str, int]) -> list[Any]:
    return [SimpleNamespace(family=f, task=f"{f}/{i}") for f, n in counts.items() for i in range(n)]


def shares(picked: list[Any], key: str) -> dict[str, float]:
    counted = Counter(getattr(d, key) for d in picked)
    return {k: v / len(picked) for k, v in counted.items()}


def test_family_sampling_gives_every_family_an_equal_share_and_its_tasks_equal_shares():
    pool = demos({"household": 4, "calc_math": 36})
    picked = pick_demonstrations(pool, DRAWS, "family", random.Random(0))
    # 6 sigma of a binomial share at p = 0.5 over 6000 draws is 0.039
    assert shares(picked, "family") == pytest.approx({"household": 0.5, "calc_math": 0.5}, abs=0.039)
    household = [d for d in picked if d.family == "household"]
    assert shares(household, "task") == pytest.approx({f"household/{i}": 0.25 for i in range(4)}, abs=0.05)


def test_task_sampling_gives_a_family_its_share_of_the_tasks():
    pool = demos({"household": 4, "calc_math": 36})
    picked = pick_demonstrations(pool, DRAWS, "task", random.Random(0))
    assert shares(picked, "family") == pytest.approx({"household": 0.1, "calc_math": 0.9}, abs=0.025)


@pytest.mark.parametrize("sampling", ["task", "family"])
def test_draws_are_a_function_of_the_seed(sampling):
    pool = demos({"household": 3, "calc_math": 5})
    first = pick_demonstrations(pool, 50, sampling, random.Random(7))
    again = pick_demonstrations(pool, 50, sampling, random.Random(7))
    other = pick_demonstrations(pool, 50, sampling, random.Random(8))
    assert [d.task for d in first] == [d.task for d in again] != [d.task for d in other]
    assert all(d in pool for d in first)


def test_one_family_is_the_same_as_task_sampling_in_distribution():
    pool = demos({"calc_math": 8})
    picked = pick_demonstrations(pool, DRAWS, "family", random.Random(1))
    assert shares(picked, "task") == pytest.approx({f"calc_math/{i}": 1 / 8 for i in range(8)}, abs=0.03)


def test_unknown_sampling_is_refused():
    with pytest.raises(ValueError, match="unknown warm-start sampling 'tasks'"):
        pick_demonstrations(demos({"calc_math": 2}), 1, "tasks", random.Random(0))


def test_config_names_the_setting_and_its_choices():
    assert load_config(TINY, ['trainer.sft_sampling="family"']).trainer.sft_sampling == "family"
    with pytest.raises(UsageError, match=r"trainer\.sft_sampling") as err:
        load_config(TINY, ['trainer.sft_sampling="uniform"'])
    assert "\n" not in str(err.value) and "family" in str(err.value)
