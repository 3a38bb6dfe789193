"""Scripted household policies (`rollart_hpc.envs.baseline`, `launch.py envs baseline`): parsing, the
explorer's choices on shown text, the settings' errors, and real games played within their turn limits."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.envs.baseline import Explorer, listed_actions, make_policy, parse_objective, play
from rollart_hpc.envs.cli import add_arguments, baseline_settings, main
from rollart_hpc.tasks.families.household import HouseholdFamily
from rollart_hpc.tasks.families.household_data import data_dir, is_ready, prepare
from rollart_hpc.tasks.types import Task

BEDROOM = """-= Bedroom =-
There is a closed wardrobe here. The bed holds a book.
Actions: 1: go north | 2: inventory | 3: open dresser | 4: open wardrobe | 5: take book from bed"""
HOLDING = """You take the book from the bed.
Actions: 1: drop book | 2: go north | 3: inventory | 4: open dresser | 5: open wardrobe | 6: put book on bed"""
OPENED = """You open the wardrobe.
Actions: 1: close wardrobe | 2: drop book | 3: go north | 4: insert book into wardrobe | 5: inventory"""
HALL = """-= Hall =-
Actions: 1: go east | 2: go south | 3: inventory | 4: open oak door"""


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["baseline", *argv])


def test_objective_and_action_list_parsing() -> None:
    assert parse_objective("Your task is to: put the book in the wardrobe.") == ("book", "wardrobe")
    assert parse_objective("put the red apple on the kitchen counter") == ("red apple", "kitchen counter")
    with pytest.raises(ValueError, match="not a put-in/put-on objective"):
        parse_objective("Your task is to: put the pillow and the fork in the dresser.")
    assert listed_actions(BEDROOM)[4] == "take book from bed" and len(listed_actions(BEDROOM)) == 5
    assert listed_actions("no list here") == []
    with pytest.raises(ValueError, match="malformed"):
        listed_actions("Actions: 1: go north | 3: go south")


def test_explorer_follows_the_cues_of_the_shown_text() -> None:
    policy = Explorer("book", "wardrobe", random.Random(0))
    assert policy(BEDROOM) == "5"  # take the object when it is listed
    assert policy(HOLDING) == "5"  # holding it: open the target
    assert policy(OPENED) == "4"  # then insert it
    searching = Explorer("book", "wardrobe", random.Random(0))
    assert searching(HALL) == "4"  # not holding, nothing to take: open what is closed first
    assert searching(HALL) in {"1", "2"}  # already opened: walk through an exit


def test_random_policy_picks_a_listed_number() -> None:
    task = Task("household/000", "household", (), 5, "", "put the book in the wardrobe.")
    policy = make_policy("random", task, random.Random(1))
    assert {policy(BEDROOM) for _ in range(200)} == {"1", "2", "3", "4", "5"}
    assert isinstance(make_policy("explorer", task, random.Random(1)), Explorer)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("oracle", task, random.Random(1))


def test_baseline_settings_reject_bad_values_in_one_line() -> None:
    assert baseline_settings(_parse()) == (["random", "explorer"], [4], ["put_on", "put_in"])
    for argv, message in (
        (("--policies", "greedy"), "--policies: unknown greedy"),
        (("--slack", "x"), "--slack: expected comma-separated integers"),
        (("--slack", "-1"), "--slack must be >= 0"),
        (("--episodes", "0"), "--episodes >= 1"),
        (("--types", "laundry"), "--types: unknown laundry"),
        (("--types", "two_obj"), "the explorer plays only"),
    ):
        with pytest.raises(UsageError, match=message):
            baseline_settings(_parse(*argv))


@pytest.fixture(scope="module")
def household_root() -> Path:
    if not is_ready():
        prepare(num_procs=2)
    return data_dir()


def test_explorer_wins_real_games_that_chance_does_not_at_the_same_budget(household_root: Path) -> None:
    family = HouseholdFamily(slack=0, types=("put_on", "put_in"), numbered=True)
    tasks = family.tasks()[:6]
    env = family.make_env()
    try:
        rng = random.Random(0)
        oracle_turns = [len(family.oracle(t.id)) for t in tasks]
        explorer = [play(env, t, make_policy("explorer", t, rng)) for t in tasks for _ in range(3)]
        chance = [play(env, t, make_policy("random", t, rng)) for t in tasks for _ in range(3)]
    finally:
        env.close()
    limits = [n for n in oracle_turns for _ in range(3)]  # slack 0: the walkthrough's own length
    assert all(r.turns <= limit for r, limit in zip(explorer, limits, strict=True))
    assert sum(r.won for r in explorer) >= 2 and sum(r.won for r in chance) == 0


def test_baseline_command_writes_per_policy_results(household_root: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "baseline.json"
    assert main(_parse("--episodes", "1", "--slack", "8", "--types", "put_on", "--json", str(out))) == 0
    result = json.loads(out.read_text())
    explorer = result["policies"]["explorer"]["8"]
    assert explorer["episodes"] == explorer["games"] == 22 and 0 < explorer["won"] <= 22
    assert sum(explorer["wins_per_game"].values()) == explorer["won"]
    assert "explorer     8" in capsys.readouterr().out
