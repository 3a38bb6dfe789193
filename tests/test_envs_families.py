"""Each family's oracle solves its tasks through the Env interface; ids, tags and limits are stable."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart_hpc.envs.cli import sample
from rollart_hpc.tasks.demos import demonstration_messages, run_oracle
from rollart_hpc.tasks.families import calc_math, frozenlake, household
from rollart_hpc.tasks.families.household_data import data_dir, game_path, is_ready, load_manifest, prepare
from rollart_hpc.tasks.registry import FAMILIES, FamilySpec, family_of, make_family


@pytest.fixture(scope="session")
def household_root() -> Path:
    """The prepared household cache (generated once when missing: a few minutes)."""
    if not is_ready():
        prepare(num_procs=2)
    return data_dir()


def _solve_all(name: str, ids: list[str]) -> list[str]:
    fam = make_family(name)
    env = fam.make_env()
    try:
        return [tid for tid in ids if not run_oracle(fam, tid, env).won]
    finally:
        env.close()


def test_registry_names_and_specs() -> None:
    assert set(FAMILIES) == {"household", "calc_math", "frozenlake"}
    assert family_of("calc_math/0001") == "calc_math"
    with pytest.raises(KeyError):
        make_family("nope")
    spec = FamilySpec.of("calc_math", max_ops=2)
    assert hash(spec) == hash(FamilySpec.of("calc_math", max_ops=2))
    assert {t.tags[1] for t in spec.build().tasks()} == {"ops1", "ops2"}


def test_calc_math_is_deterministic_and_bounded() -> None:
    fam = calc_math.CalcMathFamily()
    tasks = fam.tasks()
    assert len(tasks) == 1500 and len({t.id for t in tasks}) == 1500
    assert calc_math.generate_problem(7) == calc_math.generate_problem(7)
    for i in range(0, 1500, 37):
        p = calc_math.generate_problem(i)
        assert p.num_ops == 1 + i % 3 and 0 <= p.answer <= 200
        assert fam.task(calc_math.task_id(i)).max_turns == 4


def test_calc_math_difficulty_knob() -> None:
    easy = calc_math.CalcMathFamily(max_ops=1).tasks()
    assert len(easy) == 500 and all(t.tags[1] == "ops1" for t in easy)
    with pytest.raises(ValueError):
        calc_math.CalcMathFamily(max_ops=4)


def test_calc_math_env_protocol() -> None:
    env = calc_math.CalcMathEnv()
    p = calc_math.generate_problem(5)
    assert env.reset(calc_math.task_id(5)) == p.text
    assert env.step("I think")[0] == calc_math.FORMAT_HINT
    obs, reward, done, _ = env.step(f"<calc>{p.expression}</calc>")
    assert obs == f"= {p.answer}" and reward == 0.0 and not done
    obs, reward, done, info = env.step(f"<answer>{p.answer + 1}</answer>")
    assert (obs, reward, done, info["won"]) == ("wrong", 0.0, True, False)


def test_calc_math_oracle_sample() -> None:
    ids = sample([t.id for t in calc_math.CalcMathFamily().tasks()], 60)
    assert _solve_all("calc_math", ids) == []


@pytest.mark.slow
def test_calc_math_oracle_all() -> None:
    assert _solve_all("calc_math", [t.id for t in calc_math.CalcMathFamily().tasks()]) == []


def test_frozenlake_oracle_every_map() -> None:
    ids = [t.id for t in frozenlake.FrozenLakeFamily().tasks()]
    assert len(ids) == len(frozenlake.MAPS) >= 16
    assert _solve_all("frozenlake", ids) == []


def test_frozenlake_text_and_holes() -> None:
    env = frozenlake.FrozenLakeEnv()
    assert env.reset("frozenlake/4x4") == "P___\n_O_O\n___O\nO__G"
    obs, reward, done, _ = env.step("I go Right now")
    assert obs.startswith("_P__") and reward == 0.0 and not done
    assert env.step("jump")[0].startswith("Invalid move.")
    obs, reward, done, info = env.step("down")
    assert "X" in obs and done and reward == 0.0 and not info["won"]


def test_household_tasks(household_root: Path) -> None:
    games = load_manifest(household_root)
    assert [g["index"] for g in games] == list(range(128))
    assert {g["type"] for g in games} == {
        "put_in",
        "put_on",
        "two_obj",
        "open_then_put",
        "other_room",
        "cook",
    }
    fam = household.HouseholdFamily()
    tasks = fam.tasks()
    assert len(tasks) == 128 and tasks[0].id == "household/000"
    assert all(t.max_turns == len(fam.oracle(t.id)) + 4 for t in tasks)
    easy = household.HouseholdFamily(types=("put_on",)).tasks()
    assert easy and all("put_on" in t.tags for t in easy)


def test_household_oracle_sample(household_root: Path) -> None:
    ids = sample([household.task_id(i) for i in range(128)], 12)
    assert _solve_all("household", ids) == []


@pytest.mark.slow
def test_household_oracle_all(household_root: Path) -> None:
    assert _solve_all("household", [household.task_id(i) for i in range(128)]) == []


def test_household_observation_is_compact(household_root: Path) -> None:
    env = household.HouseholdEnv()
    try:
        obs = env.reset("household/000")
        assert "$$$$" not in obs and "Your task is to:" in obs
        last = obs.splitlines()[-1]
        assert last.startswith("Actions: ") and "look" not in last.split(" | ")
        obs, reward, done, info = env.step("dance wildly\nsecond line")
        assert not done and reward == 0.0 and not info["won"]
    finally:
        env.close()


def test_demonstration_messages() -> None:
    fam = make_family("calc_math")
    msgs = demonstration_messages(fam, "calc_math/0002")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == fam.oracle("calc_math/0002")[0]
    assert msgs[3]["content"].startswith("= ")


def _without_serial(story: bytes) -> bytes:
    """A Z-machine story file with its serial number blanked: header bytes 0x12-0x17, where Inform writes
    the compile date (YYMMDD), outside the header checksum (which sums the bytes from 0x40 on)."""
    return story[:0x12] + b"000000" + story[0x18:]


def test_household_generation_is_byte_identical(household_root: Path, tmp_path: Path) -> None:
    """Regenerating a game (PYTHONHASHSEED=0, another folder) reproduces the cached .z8 exactly but for the
    serial number, the day it was compiled (a cache prepared on another day differs there only)."""
    import hashlib
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONHASHSEED="0", TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "rollart_hpc.tasks.families.household_gen", str(tmp_path / "g"), "1", "2"]
    subprocess.run(cmd, env=env, check=True, timeout=120)
    cached = game_path(1, household_root).read_bytes()
    assert hashlib.sha256(cached).hexdigest() == load_manifest(household_root)[1]["sha256"]
    assert _without_serial((tmp_path / "g" / "game_001.z8").read_bytes()) == _without_serial(cached)


def test_household_numbered_actions(household_root: Path) -> None:
    fam = household.HouseholdFamily(types=("put_on",), numbered=True)
    task = fam.tasks()[0]
    assert "number" in task.system
    assert run_oracle(fam, task.id).won
    env = fam.make_env()
    try:
        obs = env.reset(task.id)
        assert "Actions: 1: " in obs
        obs, reward, done, info = env.step("99")
        assert "Nothing happens: '99' is not one of the actions." in obs and not done and reward == 0.0
        first = obs.split("Actions: 1: ", 1)[1].split(" | ")[0]
        obs2, *_ = env.step(first)  # the action's text is accepted too
        assert "Nothing happens" not in obs2
    finally:
        env.close()


def test_household_rejects_interpreter_commands(household_root: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = household.HouseholdFamily().make_env()
    try:
        env.reset(household.task_id(0))
        for command in ("save", "restore", "script", "quit", "save\nfoo.qzl"):
            obs, reward, done, _ = env.step(command)
            assert obs.startswith("Nothing happens") and not done and reward == 0.0
    finally:
        env.close()
    assert list(tmp_path.iterdir()) == []
