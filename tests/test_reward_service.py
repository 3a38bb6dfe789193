"""Reward as an elastic service: the pool scales to zero and cold-starts again, the service's fair
round robin between clients, idempotent request ids, refused bad requests, and a killed service that
loses no trajectory (answered after a restart, or failed with cause reward_unavailable)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from reward_running import calc_math_traj, meeting_fn, running_service

from rollart_hpc.config import load_config
from rollart_hpc.config.schema import RewardConfig
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.reward.client import ServiceClient, request_id
from rollart_hpc.reward.functions import REWARD_FNS, RewardInput, RewardOutput
from rollart_hpc.reward.pool import RewardPool, RewardPoolConfig
from rollart_hpc.reward.scheduler import FairScheduler
from rollart_hpc.reward.wire import ADDRESS_FILE, TOKEN_FILE, encode, input_to_dict

REPO = Path(__file__).resolve().parent.parent


def _inp(index: int) -> RewardInput:
    return RewardInput.of(calc_math_traj(index))


# --- the elastic pool ---------------------------------------------------------------------------------


def test_pool_scales_to_zero_and_cold_starts_again() -> None:
    pool = RewardPool(RewardPoolConfig(max_workers=2, executor="process", idle_shutdown_s=0.0))

    async def go() -> list[Trajectory]:
        first = await pool.score_many([calc_math_traj(i) for i in range(3)])
        assert pool.num_workers == 0  # idle: scaled to zero
        return first + await pool.score_many([calc_math_traj(7, right=False)])

    try:
        scored = asyncio.run(go())
    finally:
        pool.close()
    assert [t.reward for t in scored] == [1.0, 1.0, 1.0, 0.0]
    stats = pool.stats()
    assert stats["cold_starts"] >= 2 and stats["workers_now"] == 0 and stats["scored"] == 4
    assert 0 < stats["cold_start_s_max"] < 30 and stats["busy_s"] > 0 and stats["worker_s"] >= stats["busy_s"]


def test_pool_grows_under_queue_pressure_up_to_its_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REWARD_FNS, "slow", meeting_fn(3))  # passes only once three calls run at once
    cfg = RewardPoolConfig(max_workers=3, idle_shutdown_s=60.0, fn_for_family={"calc_math": "slow"})
    pool = RewardPool(cfg)
    scored = asyncio.run(pool.score_many([calc_math_traj(i) for i in range(6)]))
    assert [t.reward for t in scored] == [0.5] * 6
    assert pool.peak_workers == 3 == pool.cold_starts and pool.num_workers == 3  # not idle long enough
    assert set(pool.stats()["worker_busy_s"]) == {"0", "1", "2"}
    pool.close()


def test_scale_up_waits_for_a_queue_of_scale_up_queue() -> None:
    pool = RewardPool(RewardPoolConfig(max_workers=4, scale_up_queue=100))
    asyncio.run(pool.score_many([calc_math_traj(i) for i in range(8)]))
    assert pool.peak_workers == 1  # never 100 waiting: one worker served them all
    pool.close()


def test_reward_config_checks() -> None:
    with pytest.raises(UsageError, match=r"^reward.service: 'nohost' is not of the form host:port$"):
        RewardConfig(service="nohost").validate("reward")
    with pytest.raises(UsageError, match=r"roles.reward.num_ranks: must be >= 1 \(0 would train unscored"):
        load_config(REPO / "configs/tiny.toml", ["roles.reward.num_ranks=0"])
    RewardConfig(service="node-1.cluster:5555").validate("reward")


# --- the scheduler ------------------------------------------------------------------------------------


def test_scheduler_round_robin_quota_and_idempotent_ids() -> None:
    sched = FairScheduler(quota=3)
    for i in range(3):
        assert sched.submit("pa", "run-a", f"a{i}", _inp(i)) is None
    refused = sched.submit("pa", "run-a", "a3", _inp(3))
    assert (
        refused is not None
        and refused["status"] == "error"
        and refused["retry"]
        and "quota" in refused["error"]
    )
    assert sched.submit("pb", "run-b", "b0", _inp(0)) is None
    assert sched.submit("pb2", "run-b", "b0", _inp(0)) is None  # same id again: joins, not queued twice
    order = []
    while (item := sched.next()) is not None:
        order.append(item[0])
    assert order == [("run-a", "a0"), ("run-b", "b0"), ("run-a", "a1"), ("run-a", "a2")]
    assert sched.complete(("run-b", "b0"), {"id": "b0", "status": "ok", "reward": 1.0}) == ["pb", "pb2"]
    cached = sched.submit("pb3", "run-b", "b0", _inp(0))
    assert cached is not None and cached["cached"] and sched.counts["run-b"].scored == 1


def test_request_id_is_stable_for_a_resend_and_new_for_other_actions() -> None:
    same = [request_id("ep1", input_to_dict(_inp(3))) for _ in range(2)]
    other = request_id("ep1", input_to_dict(RewardInput.of(calc_math_traj(3, right=False))))
    assert same[0] == same[1] != other and same[0].startswith("ep1:")


# --- the service in this process ----------------------------------------------------------------------


def _cfg(**kw: object) -> RewardConfig:
    base = RewardConfig(
        executor="thread", max_workers=1, idle_shutdown_s=0.2, service_timeout_s=1.0, service_deadline_s=10.0
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_service_token_file_is_private_and_scores_for_two_clients(tmp_path: Path) -> None:
    cfg = _cfg(service_dir=str(tmp_path / "svc"))

    async def go() -> tuple[list[Trajectory], list[Trajectory], dict[str, object]]:
        async with running_service(tmp_path, cfg) as service:
            a, b = ServiceClient(cfg, "run-a"), ServiceClient(cfg, "run-b")
            ra, rb = await asyncio.gather(
                asyncio.gather(*(a.score(calc_math_traj(i)) for i in range(5))),
                asyncio.gather(*(b.score(calc_math_traj(i, right=False)) for i in range(5))),
            )
            a.close(), b.close()
            deadline = time.monotonic() + 30  # idle past idle_shutdown_s: the pool lets its worker go
            while service.stats()["pool"]["workers_now"]:  # type: ignore[index]
                assert time.monotonic() < deadline, "the idle pool kept its worker"
                await asyncio.sleep(0.05)
            return list(ra), list(rb), service.stats()

    ra, rb, stats = asyncio.run(go())
    assert [t.reward for t in ra] == [1.0] * 5 and [t.reward for t in rb] == [0.0] * 5
    assert all(t.status == "ok" for t in ra + rb)
    assert stats["clients"] == {  # same episode ids, but two clients: scored apart
        "run-a": {"requests": 5, "scored": 5, "cached": 0, "refused": 0},
        "run-b": {"requests": 5, "scored": 5, "cached": 0, "refused": 0},
    }
    assert (tmp_path / "svc" / TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "svc" / ADDRESS_FILE).exists()  # removed on a clean stop
    assert stats["pool"]["workers_now"] == 0 and stats["pool"]["cold_starts"] == 1  # type: ignore[index]


def test_service_serves_clients_round_robin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []

    def record(inp: RewardInput) -> RewardOutput:
        order.append(inp.task_id[0])
        time.sleep(0.02)
        return RewardOutput(1.0, True)

    monkeypatch.setitem(REWARD_FNS, "calc_math", record)
    cfg = _cfg(service_dir=str(tmp_path / "svc"))

    async def go() -> None:
        async with running_service(tmp_path, cfg):
            a, b = ServiceClient(cfg, "run-a"), ServiceClient(cfg, "run-b")
            inp = input_to_dict(_inp(1))
            heavy = [a.request(f"a{i}", {**inp, "task_id": "a"}) for i in range(20)]
            light = [b.request(f"b{i}", {**inp, "task_id": "b"}) for i in range(4)]
            await asyncio.gather(*heavy, *light)
            a.close(), b.close()

    asyncio.run(go())
    assert len(order) == 24
    # b's four requests were all served within the first ten calls, not after a's twenty
    assert max(i for i, c in enumerate(order) if c == "b") < 10, "".join(order)


def test_retried_request_is_scored_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def once(inp: RewardInput) -> RewardOutput:
        calls.append(inp.task_id)
        time.sleep(0.05)
        return RewardOutput(1.0, True)

    monkeypatch.setitem(REWARD_FNS, "calc_math", once)
    cfg = _cfg(service_dir=str(tmp_path / "svc"))

    async def go() -> list[dict[str, object]]:
        async with running_service(tmp_path, cfg):
            a = ServiceClient(cfg, "run-a")
            inp = input_to_dict(_inp(1))
            b = ServiceClient(cfg, "run-a")  # a second rank of the same run
            first = await asyncio.gather(a.request("x", inp), b.request("x", inp))
            again = await a.request("x", inp)
            a.close(), b.close()
            return [*first, again]

    replies = asyncio.run(go())
    assert calls == ["calc_math/0001"]  # scored once for three sends of the same id
    assert [r["status"] for r in replies] == ["ok"] * 3 and replies[2]["cached"] is True


def test_bad_requests_get_clear_errors_and_do_not_hurt_others(tmp_path: Path) -> None:
    cfg = _cfg(service_dir=str(tmp_path / "svc"), service_max_request_bytes=4096)

    async def go() -> tuple[list[dict[str, object]], Trajectory]:
        async with running_service(tmp_path, cfg) as service:
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.connect(service.address)
            good = {
                "op": "score",
                "token": service.token,
                "client": "evil",
                "id": "1",
                "input": input_to_dict(_inp(1)),
            }
            bad = [
                encode({**good, "token": "not-the-token"}),
                b"{not json",
                encode({**good, "input": {"task_id": "x"}}),
                encode({**good, "pad": "x" * 5000}),
                encode({**good, "op": "drop_tables"}),
            ]
            replies = []
            for frame in bad:
                await sock.send(frame)
                replies.append(json.loads(await asyncio.wait_for(sock.recv(), 5)))
            sock.close(0), ctx.term()
            client = ServiceClient(cfg, "run-a")
            traj = await client.score(calc_math_traj(2))
            client.close()
            return replies, traj

    replies, traj = asyncio.run(go())
    assert [r["status"] for r in replies] == ["error"] * 5 and not any(r["retry"] for r in replies)
    errors = [str(r["error"]) for r in replies]
    assert errors[0] == "unauthorized: wrong or missing token"
    assert errors[1].startswith("malformed request: not JSON")
    assert errors[2].startswith("malformed request: bad input")
    assert errors[3].startswith("request too large: ") and errors[3].endswith(" bytes > limit 4096")
    assert errors[4] == "malformed request: unknown op 'drop_tables'"
    assert (traj.status, traj.reward) == ("ok", 1.0)


def test_client_with_a_wrong_token_fails_its_trajectory_with_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> Trajectory:
        async with running_service(tmp_path, _cfg()) as service:
            monkeypatch.setenv("ROLLART_REWARD_TOKEN", "wrong")
            client = ServiceClient(_cfg(service=service.address.removeprefix("tcp://")), "run-a")
            traj = await client.score(calc_math_traj(1))
            client.close()
            return traj

    traj = asyncio.run(go())
    assert (traj.status, traj.finish_cause, traj.error) == (
        "failed",
        "reward_error",
        "unauthorized: wrong or missing token",
    )


# --- a service process that is killed -----------------------------------------------------------------


@contextmanager
def _service_process(service_dir: Path, *overrides: str) -> Iterator[subprocess.Popen[bytes]]:
    (service_dir / ADDRESS_FILE).unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "launch.py"),
            "reward-service",
            "configs/tiny.toml",
            "--run-dir",
            str(service_dir),
            "reward.max_workers=1",
            "reward.idle_shutdown_s=0.5",
            *overrides,
        ],
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 60
        while not (service_dir / ADDRESS_FILE).exists():
            assert proc.poll() is None and time.monotonic() < deadline, "reward service did not start"
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def test_killed_service_loses_no_trajectory(tmp_path: Path) -> None:
    svc = tmp_path / "svc"
    cfg = RewardConfig(service_dir=str(svc), service_timeout_s=0.5, service_deadline_s=30.0)
    num = 60

    async def go() -> tuple[list[Trajectory], int, list[Trajectory]]:
        with _service_process(svc) as proc:
            client = ServiceClient(cfg, "run-a")
            tasks: list[asyncio.Task[Trajectory]] = []
            killed = asyncio.Event()

            async def stream() -> None:  # one trajectory every 10 ms, through the kill and the restart
                for i in range(num):
                    if i == num // 2:
                        await killed.wait()  # the second half goes out while the service is down
                    tasks.append(asyncio.create_task(client.score(calc_math_traj(i))))
                    await asyncio.sleep(0.01)

            sender = asyncio.create_task(stream())
            while sum(t.done() for t in tasks) < 5:
                await asyncio.sleep(0.005)
            os.kill(proc.pid, signal.SIGKILL)  # mid-stream
            proc.wait()
            sent_before_kill = len(tasks)
            killed.set()
        with _service_process(svc):  # a new port and token: the client reads them again
            await sender
            scored = list(await asyncio.gather(*tasks))
        client.close()
        # no service at all: past the deadline, failed with the cause
        short = ServiceClient(replace(cfg, service_timeout_s=0.2, service_deadline_s=1.0), "run-b")
        lost = list(await asyncio.gather(*(short.score(calc_math_traj(i)) for i in range(3))))
        short.close()
        return scored, sent_before_kill, lost

    start = time.monotonic()
    scored, sent_before_kill, lost = asyncio.run(go())
    assert sent_before_kill < num, "the kill came after the stream ended"
    assert [(t.status, t.reward) for t in scored] == [("ok", 1.0)] * num
    stats = json.loads((svc / "stats.json").read_text())  # the second service's
    answered = stats["clients"]["run-a"]["scored"] + stats["clients"]["run-a"]["cached"]
    assert answered >= num - sent_before_kill  # what was sent after the kill, the restarted service answered
    journal = [json.loads(line)["reply"]["id"] for line in (svc / "results.jsonl").read_text().splitlines()]
    assert len(set(journal)) == num and len(journal) <= num + 1  # at most the one in a worker at the kill
    assert [(t.status, t.finish_cause) for t in lost] == [("failed", "reward_unavailable")] * 3
    assert "no reply from the reward service" in lost[0].error
    assert time.monotonic() - start < 60


@pytest.mark.mpi
@pytest.mark.slow
def test_two_tiny_runs_share_one_service_with_exact_accounting(tmp_path: Path) -> None:
    svc = tmp_path / "svc"
    with _service_process(svc, "reward.max_workers=2"):
        runs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(REPO / "launch.py"),
                    "run",
                    "configs/tiny.toml",
                    "--run-dir",
                    str(tmp_path / name),
                    f"reward.service_dir={svc}",
                    "controller.num_steps=2",
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for name in ("run-a", "run-b")
        ]
        for proc in runs:
            out, _ = proc.communicate(timeout=900)
            assert proc.returncode == 0, out[-3000:].decode(errors="replace")
    stats = json.loads((svc / "stats.json").read_text())
    for name in ("run-a", "run-b"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["balanced"], summary["accounting"]
        assert not any("reward_" in k for k in summary["trajectories"]), summary["trajectories"]
        client = stats["clients"][str((tmp_path / name).resolve())]
        (rank_file,) = (tmp_path / name / "reward").glob("rank-*.json")
        rank = json.loads(rank_file.read_text())
        assert 0 < client["scored"] <= rank["requests"] and rank["unavailable"] == rank["errors"] == 0
    assert stats["pool"]["cold_starts"] >= 1 and stats["pool"]["peak_workers"] <= 2


def test_reward_bench_writes_the_side_by_side_numbers(tmp_path: Path) -> None:
    from rollart_hpc.entry import cli

    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "reward",
        "--json",
        str(out),
        "--runs",
        "2",
        "--phases",
        "2",
        "--burst",
        "4",
        "--gap-s",
        "1.0",
    ]
    assert cli.main([*argv, "--idle-s", "0.2"]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 16
    assert 0 < result["worker_seconds_shared_vs_dedicated"] < 1
    assert 0 < result["utilisation_dedicated"] <= 1 and 0 < result["utilisation_shared"] <= 1
    assert result["shared"]["cold_starts"] >= 1 and result["dedicated"]["cold_starts"] == 0
