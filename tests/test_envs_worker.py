"""Env workers: concurrent episodes in child processes; crashes, hangs and errors become counted failures."""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter
from typing import Any

import pytest

from rollart_hpc.contracts.generation import RequestOutput, SamplingParams
from rollart_hpc.envs.faults import FaultConfig, LatencyConfig, expected_cause, plan_step
from rollart_hpc.envs.worker import EnvWorker, EnvWorkerConfig
from rollart_hpc.tasks.agent_loop import AgentConfig
from rollart_hpc.tasks.chat import ChatTokens
from rollart_hpc.tasks.registry import make_family
from rollart_hpc.tasks.types import Task


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from rollart_hpc.models.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer()


class OracleClient:
    """Replies with the oracle's action for the episode's turn (request ids are "<episode>/t<turn>")."""

    def __init__(self, chat: ChatTokens, delay_s: float = 0.0) -> None:
        self.chat, self.delay_s = chat, delay_s
        self.families: dict[str, Any] = {}
        self.aborted: list[str] = []

    async def generate(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> RequestOutput:
        episode, _, turn = request_id.rpartition("/t")
        tid = episode.split("#")[0]
        await asyncio.sleep(self.delay_s)
        family = tid.split("/")[0]
        if family not in self.families:
            self.families[family] = make_family(family)
        text = self.families[family].oracle(tid)[int(turn)]
        ids = self.chat.encode(text) + [self.chat.stop_token_ids[0]]
        return RequestOutput(request_id, prompt, ids, [0.0] * len(ids), [7] * len(ids), text, True, "stop")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.add(pid)
    return alive


async def _run_worker(tokenizer: Any, cfg: EnvWorkerConfig, tasks: list[Task], ids: list[str], client: Any):  # type: ignore[no-untyped-def]
    worker = EnvWorker(cfg, AgentConfig(max_context_tokens=16384), tokenizer)
    seen: set[int] = set()
    async with worker:

        async def run(task: Task, eid: str):  # type: ignore[no-untyped-def]
            traj = await worker.run_episode(task, client, {"i": eid}, eid)
            seen.update(worker.live_pids())
            return traj

        trajs = await asyncio.gather(*(run(t, e) for t, e in zip(tasks, ids, strict=True)))
    return worker, list(trajs), seen


def test_fault_injection_counts_match_exactly(tokenizer: Any) -> None:
    """200 episodes, 20% of steps crash or hang (a hang sleeps until killed, so the step timeout is far above
    a healthy step even on a loaded box): every episode finishes; causes match the injection plan."""
    faults = FaultConfig(seed=11, crash_prob=0.1, hang_prob=0.1)
    cfg = EnvWorkerConfig(num_slots=16, step_timeout_s=4.0, reset_timeout_s=20.0, faults=faults)
    fam = make_family("calc_math")
    tasks = [fam.task(f"calc_math/{i:04d}") for i in range(200)]
    ids = [f"{t.id}#0" for t in tasks]
    client = OracleClient(ChatTokens(tokenizer))
    worker, trajs, seen = asyncio.run(_run_worker(tokenizer, cfg, tasks, ids, client))
    expected = Counter(expected_cause(faults, eid, 2) or "done" for eid in ids)
    assert expected["crash"] > 10 and expected["timeout"] > 10
    assert len(trajs) == 200 and Counter(t.finish_cause for t in trajs) == expected
    assert worker.counts == expected
    for traj, eid in zip(trajs, ids, strict=True):
        traj.validate()
        assert traj.dispatch == {"i": eid}
        assert traj.finish_cause == (expected_cause(faults, eid, 2) or "done")
        assert (traj.status == "ok") == (traj.finish_cause == "done")
        assert traj.status != "ok" or traj.env_won
    assert worker.live_pids() == set() and seen and _alive(seen) == set()
    assert _descendants_besides_forkserver() == []


def _descendants_besides_forkserver() -> list[int]:
    """Processes below this one, except multiprocessing's shared helpers (fork server, resource tracker)."""
    import psutil

    left = []
    for proc in psutil.Process().children(recursive=True):
        try:
            helper = any(name in " ".join(proc.cmdline()) for name in ("forkserver", "resource_tracker"))
            if not helper and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return left


def test_env_exception_becomes_error_and_child_is_reused(tokenizer: Any) -> None:
    faults = FaultConfig(seed=3, error_prob=0.3)
    cfg = EnvWorkerConfig(num_slots=2, faults=faults)
    fam = make_family("frozenlake")
    tasks = [fam.task("frozenlake/4x4")] * 12
    ids = [f"frozenlake/4x4#{k}" for k in range(12)]
    worker, trajs, seen = asyncio.run(
        _run_worker(tokenizer, cfg, tasks, ids, OracleClient(ChatTokens(tokenizer)))
    )
    n_steps = len(fam.oracle("frozenlake/4x4"))
    expected = Counter(expected_cause(faults, eid, n_steps) or "done" for eid in ids)
    assert expected["error"] > 0 and Counter(t.finish_cause for t in trajs) == expected
    assert all("InjectedError" in t.error for t in trajs if t.finish_cause == "error")
    assert len(seen) <= 2  # errors do not cost a child
    assert _alive(seen) == set()


def test_household_episodes_in_children(tokenizer: Any) -> None:
    from rollart_hpc.tasks.families.household_data import is_ready, prepare

    if not is_ready():
        prepare(num_procs=2)
    fam = make_family("household")
    tasks = [fam.task("household/000"), fam.task("household/005"), fam.task("household/000")]
    ids = [f"{t.id}#{k}" for k, t in enumerate(tasks)]
    cfg = EnvWorkerConfig(num_slots=2)
    worker, trajs, seen = asyncio.run(
        _run_worker(tokenizer, cfg, tasks, ids, OracleClient(ChatTokens(tokenizer)))
    )
    assert [(t.status, t.finish_cause, t.env_won) for t in trajs] == [("ok", "done", True)] * 3
    assert [t.num_turns for t in trajs] == [len(fam.oracle(t.id)) for t in tasks]
    assert _alive(seen) == set()


def test_episode_time_limit_aborts_the_llm_request(tokenizer: Any) -> None:
    cfg = EnvWorkerConfig(num_slots=1, episode_timeout_s=4.0)
    fam = make_family("calc_math")
    client = OracleClient(ChatTokens(tokenizer), delay_s=60.0)
    worker, trajs, seen = asyncio.run(
        _run_worker(tokenizer, cfg, [fam.task("calc_math/0000")], ["calc_math/0000#0"], client)
    )
    assert trajs[0].failure_cause == "timeout" and client.aborted == ["calc_math/0000#0/t0"]
    assert worker.counts == {"timeout": 1} and _alive(seen) == set()


def test_unknown_task_is_an_error_not_a_crash(tokenizer: Any) -> None:
    cfg = EnvWorkerConfig(num_slots=1)
    bogus = Task("calc_math/9999", "calc_math", ("calc_math",), 3, "s", "p")
    worker, trajs, _ = asyncio.run(
        _run_worker(tokenizer, cfg, [bogus], ["x#0"], OracleClient(ChatTokens(tokenizer)))
    )
    assert trajs[0].failure_cause == "error" and "unknown calc_math task id" in trajs[0].error


def test_fault_plan_is_deterministic_and_long_tailed() -> None:
    cfg = FaultConfig(
        seed=1, crash_prob=0.1, slow_prob=0.1, slow_s=0.5, latency=LatencyConfig("pareto", 0.01, alpha=1.2)
    )
    plans = [plan_step(cfg, f"e{k}", 0) for k in range(2000)]
    assert plans == [plan_step(cfg, f"e{k}", 0) for k in range(2000)]
    kinds = Counter(p.kind for p in plans)
    assert 150 < kinds["crash"] < 250 and 150 < kinds["slow"] < 250
    delays = sorted(p.delay_s for p in plans if p.kind == "none")
    assert delays[0] >= 0.01 and delays[-1] > 20 * delays[len(delays) // 2]
    lognormal = LatencyConfig("lognormal", 0.02, sigma=1.0)
    draws = sorted(lognormal.draw(random.Random(k)) for k in range(1001))
    assert 0.015 < draws[500] < 0.027
    with pytest.raises(ValueError):
        FaultConfig(crash_prob=0.7, hang_prob=0.7)
