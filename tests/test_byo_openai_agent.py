"""`envs.agent`, an agent of the run's own written against the OpenAI API: the config checks (one-line
usage errors naming the key, exit 2), its reward route, and the example's agent and tool."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from launching import usage_error_line

from rollart_hpc.config import load_config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.reward.functions import reward_fn
from rollart_hpc.tasks.build import own_family_rewards, run_tasks
from rollart_hpc.tasks.checks import check_own_code
from rollart_hpc.tasks.rewards import AGENT_RETURN, RewardInput, RewardOutput

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "openai_agent" / "config.toml"


def test_the_example_config_checks_and_rewards_every_family_by_the_agents_return():
    config = load_config(EXAMPLE)
    assert config.envs.agent == "calc_agent:run"
    lines = check_own_code(config.envs, config.reward, config.run.python_path)
    assert lines == ["dataset arith: 24 tasks (20 train, 4 held-out)"]
    assert own_family_rewards(config.envs) == {"arith": AGENT_RETURN}
    assert all(t.max_turns == 3 for t in run_tasks(config.envs))
    fn = reward_fn(AGENT_RETURN)
    assert fn(RewardInput("arith/0", "arith", ("x",), 0.75, True)) == RewardOutput(0.75, True)
    plain = load_config(REPO / "examples" / "jsonl_tasks" / "config.toml")
    assert plain.envs.agent == "" and own_family_rewards(plain.envs) == {
        "trivia": "rollart_hpc.tasks.rewards:env_won"
    }


@pytest.mark.parametrize(
    ("agent", "message"),
    [
        ("calc_agent:nope", r"envs\.agent: 'calc_agent:nope': 'calc_agent' has no attribute 'nope'"),
        ("no_such_pkg:run", r"envs\.agent: 'no_such_pkg:run': cannot import 'no_such_pkg'"),
        ("calc_agent:calculator", r"envs\.agent: 'calc_agent:calculator' is not an async function"),
        ("calc_agent:TOOLS", r"envs\.agent: 'calc_agent:TOOLS' names a list, not a callable"),
        ("one_arg_agent:run", r"envs\.agent: 'one_arg_agent:run' does not take two arguments"),
    ],
)
def test_a_bad_agent_is_a_one_line_usage_error_naming_the_key(tmp_path, agent, message):
    (tmp_path / "one_arg_agent.py").write_text("async def run(client):\n    return 0.0\n")
    config = load_config(EXAMPLE, [f"envs.agent='{agent}'", f"run.python_path=['.', '{tmp_path}']"])
    with pytest.raises(UsageError, match=message) as info:
        check_own_code(config.envs, config.reward, config.run.python_path)
    assert "\n" not in str(info.value)


def test_a_malformed_agent_path_is_refused_when_the_config_loads():
    with pytest.raises(UsageError, match=r"envs\.agent: 'calc_agent\.run' is not an import path"):
        load_config(EXAMPLE, ["envs.agent='calc_agent.run'"])


def test_launch_exits_2_with_one_line_for_a_missing_agent(tmp_path):
    line = usage_error_line("run", EXAMPLE, "envs.agent='calc_agent:missing'", "--run-dir", tmp_path / "run")
    assert "envs.agent" in line and "'calc_agent:missing'" in line, line
    assert not (tmp_path / "run").exists()


def test_the_examples_calculator_tool():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import calc_agent
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    assert calc_agent.calculator("12 * 4 + 13") == "61"
    assert calc_agent.calculator("7 / 2") == "3.5"
    assert calc_agent.calculator("__import__('os')").startswith("error:")
    assert calc_agent.call_tool("calculator", '{"expression": "(2+3)*4"}') == "20"
    assert calc_agent.call_tool("search", "{}").startswith("error:")
