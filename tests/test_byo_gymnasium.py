"""Text gymnasium envs as a family (`rollart_hpc.api.gymnasium_family`): tasks by seed, oracle, checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart_hpc.config import load_config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.tasks.build import family_specs, run_tasks
from rollart_hpc.tasks.checks import check_own_code
from rollart_hpc.tasks.demos import demonstration_messages, run_oracle

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "gym_text" / "config.toml"
BASE = "name='guess', oracle='guess_env:solve', num_tasks=4, num_heldout=2"


def _plugins(options: str = "env='guess_env:GuessEnv'") -> str:
    factory = "rollart_hpc.api:gymnasium_family"
    return f"envs.plugins=[{{name='guess', factory='{factory}', options={{{BASE}, {options}}}}}]"


def test_tasks_are_seeds_and_the_oracle_wins_each():
    config = load_config(CONFIG, [_plugins()])
    assert check_own_code(config.envs, config.reward, config.run.python_path) == []
    family = family_specs(config.envs, config.run.python_path)["guess"].build()
    assert [t.id for t in run_tasks(config.envs)] == ["guess/0", "guess/1", "guess/2", "guess/3"]
    assert [t.id for t in family.heldout_tasks(5)] == ["guess/4", "guess/5"]
    assert family.task("guess/1").prompt == "Find the number from 1 to 16."
    for tid in ["guess/0", "guess/3", "guess/5"]:
        assert run_oracle(family, tid).won
    assert demonstration_messages(family, "guess/2")[-1]["role"] == "assistant"
    with pytest.raises(KeyError):
        family.task("guess/6")


def test_steps_pass_the_reply_and_report_truncation_as_done_without_a_win():
    config = load_config(CONFIG, [_plugins("env='guess_env:GuessEnv', env_kwargs={max_guesses=2}")])
    env = family_specs(config.envs, config.run.python_path)["guess"].build().make_env()
    env.reset("guess/0")
    assert env.step("<guess>99</guess>") == ("lower", 0.0, False, {"won": False})
    observation, reward, done, info = env.step("no guess")
    assert observation.startswith("error") and done and not info["won"]
    env.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("env='guess_env:nope'", r"envs\.plugins\[0\]\.options: .*'guess_env' has no attribute 'nope'"),
        (
            "env='builtins:dict'",
            r"envs\.plugins\[0\]\.factory: .*raised TypeError: 'builtins:dict' made a dict, not",
        ),
        (
            "env='gymnasium.envs.toy_text.frozen_lake:FrozenLakeEnv'",
            r"raised TypeError: gymnasium\.envs\..*:FrozenLakeEnv reset observation is a int, not a str",
        ),
    ],
)
def test_a_bad_env_is_a_one_line_error_naming_the_key(extra, message):
    config = load_config(CONFIG, [_plugins(extra)])
    with pytest.raises(UsageError, match=message) as info:
        check_own_code(config.envs, config.reward, config.run.python_path)
    assert "\n" not in str(info.value)
