"""Reward calls that fail are retried, a broken worker pool is rebuilt, an unscorable trajectory fails."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.reward.functions import REWARD_FNS, RewardInput, RewardOutput
from rollart_hpc.reward.pool import RewardPool, RewardPoolConfig


def _traj() -> Trajectory:
    t = Trajectory("flaky/0", "flaky", ("flaky",), "flaky/0#0", actions=["x"], env_won=True)
    t.finish_cause, t.num_turns, t.llm_s, t.env_s = "done", 1, [0.1], [0.1]
    return t


def _flaky(num_failures: int) -> tuple[list[int], object]:
    calls: list[int] = []

    def flaky(inp: RewardInput) -> RewardOutput:
        calls.append(1)
        if len(calls) <= num_failures:
            raise ValueError(f"flaky call {len(calls)}")
        return RewardOutput(1.0, True)

    return calls, flaky


def _score(
    monkeypatch: pytest.MonkeyPatch, fn: object, config: RewardPoolConfig
) -> tuple[Trajectory, RewardPool]:
    """Scores one trajectory of the family "flaky" with `fn` as its reward function, in a pool of `config`."""
    monkeypatch.setitem(REWARD_FNS, "flaky", fn)
    pool = RewardPool(config)
    traj = asyncio.run(pool.score(_traj()))
    pool.close()
    return traj, pool


def test_a_failing_reward_call_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, flaky = _flaky(2)
    traj, pool = _score(monkeypatch, flaky, RewardPoolConfig(max_score_attempts=3))
    assert (len(calls), traj.status, traj.reward, traj.success) == (3, "ok", 1.0, True)
    assert (pool.failures, pool.rebuilds, pool.num_scored) == (2, 0, 1)


def test_a_trajectory_that_cannot_be_scored_fails_with_a_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, flaky = _flaky(3)
    traj, pool = _score(monkeypatch, flaky, RewardPoolConfig(max_score_attempts=3))
    assert (len(calls), traj.status, traj.failure_cause, traj.reward, traj.success) == (
        3,
        "failed",
        "reward_error",
        0.0,
        False,
    )
    assert "flaky call 3" in traj.error and pool.failures == 3 and pool.num_scored == 0
    traj.validate()


def _die_once(inp: RewardInput) -> RewardOutput:
    """Kills its process worker the first time (a marker file remembers), then scores."""
    marker = Path(os.environ["REWARD_RETRY_MARKER"])
    if not marker.exists():
        marker.write_text("died")
        os._exit(3)
    return RewardOutput(0.5, False)


def test_a_broken_process_pool_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("REWARD_RETRY_MARKER", str(tmp_path / "died"))
    config = RewardPoolConfig(max_workers=1, executor="process", max_score_attempts=2)
    traj, pool = _score(monkeypatch, _die_once, config)
    assert (traj.status, traj.reward, pool.failures, pool.rebuilds) == ("ok", 0.5, 1, 1)


def test_injected_reward_faults_are_seeded() -> None:
    def outcomes(seed: int) -> list[str]:
        pool = RewardPool(RewardPoolConfig(max_score_attempts=1, fault_prob=0.5, fault_seed=seed))
        trajs = [_traj() for _ in range(12)]
        for t in trajs:
            t.family, t.task_id = "calc_math", "calc_math/0001"
        out = asyncio.run(pool.score_many(trajs))
        pool.close()
        return [t.status for t in out]

    assert outcomes(1) == outcomes(1) and "failed" in outcomes(1) and "ok" in outcomes(1)
