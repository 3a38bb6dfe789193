"""Reward functions per family and the concurrent reward pool."""

from __future__ import annotations

import asyncio

import pytest
from reward_running import meeting_fn

from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.reward.functions import REWARD_FNS, RewardInput, RewardOutput, reward_fn
from rollart_hpc.reward.pool import RewardPool, RewardPoolConfig
from rollart_hpc.tasks.families import calc_math
from rollart_hpc.tasks.families.calc_math import generate_problem


def _traj(task_id: str, actions: list[str], won: bool = False, status: str = "ok") -> Trajectory:
    family = task_id.split("/")[0]
    t = Trajectory(task_id, family, (family,), f"{task_id}#0", actions=actions, env_won=won)
    t.status, t.finish_cause = status, ("done" if status == "ok" else "crash")  # type: ignore[assignment]
    return t


def test_registry_covers_every_family() -> None:
    assert set(REWARD_FNS) == {"household", "calc_math", "frozenlake"}
    with pytest.raises(KeyError):
        reward_fn("unknown")


def test_calc_math_reward_recomputes_the_gold_answer() -> None:
    gold = generate_problem(9).answer
    right = RewardInput(
        "calc_math/0009", "calc_math", ("<calc>1</calc>", f"<answer>{gold}</answer>"), 0.0, False
    )
    wrong = RewardInput("calc_math/0009", "calc_math", (f"<answer>{gold + 1}</answer>",), 1.0, True)
    assert calc_math.score(right) == RewardOutput(1.0, True)
    assert calc_math.score(wrong) == RewardOutput(0.0, False)  # the env's claim is not trusted
    assert calc_math.score(RewardInput("calc_math/0009", "calc_math", (), 0.0, False)).reward == 0.0


def test_pool_scores_concurrently_and_skips_failed() -> None:
    gold = generate_problem(4).answer
    trajs = [
        _traj("calc_math/0004", [f"<answer>{gold}</answer>"]),
        _traj("household/001", ["go north"], won=True),
        _traj("frozenlake/4x4", ["left"], won=False),
        _traj("household/002", ["x"], won=True, status="failed"),
    ]
    pool = RewardPool(RewardPoolConfig(max_workers=2))
    scored = asyncio.run(pool.score_many(trajs))
    assert [(t.reward, t.success) for t in scored] == [(1.0, True), (1.0, True), (0.0, False), (0.0, False)]
    assert pool.num_scored == 3
    pool.close()


def test_pool_runs_in_parallel_and_scales_to_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REWARD_FNS, "slow", meeting_fn(3))  # passes only once three calls run at once
    pool = RewardPool(
        RewardPoolConfig(max_workers=3, idle_shutdown_s=0.0, fn_for_family={"frozenlake": "slow"})
    )
    scored = asyncio.run(pool.score_many([_traj("frozenlake/4x4", ["up"]) for _ in range(3)]))
    assert [t.reward for t in scored] == [0.5, 0.5, 0.5]
    assert pool.num_workers == 0 and pool.peak_workers == 3  # idle pool stopped its workers


def test_async_judge_is_awaited(monkeypatch: pytest.MonkeyPatch) -> None:
    async def judge(inp: RewardInput) -> RewardOutput:
        await asyncio.sleep(0)
        return RewardOutput(0.25, True)

    monkeypatch.setitem(REWARD_FNS, "judge", judge)
    pool = RewardPool(RewardPoolConfig(fn_for_family={"household": "judge"}))
    traj = asyncio.run(pool.score(_traj("household/003", ["look"])))
    assert (traj.reward, traj.success) == (0.25, True) and pool.peak_workers == 0  # no worker for a judge
