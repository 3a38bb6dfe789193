"""The standalone reward service: one process that scores reward requests from any number of runs.

Dataflow: a zmq ROUTER socket receives one JSON request per frame (`rollart_hpc.reward.wire`). The
receive loop checks each request (size, JSON, token, fields) and refuses a bad one with an error reply
naming the problem, so a bad client never affects the others; a good one goes to the `FairScheduler`
(cached result, quota refusal, or queued). The dispatch loop takes requests round robin over clients
while fewer than `admit` are being scored and scores each in the elastic `RewardPool` (workers start
under load and stop when idle, so an idle service holds no worker); the reply goes to every peer that
sent that id. A request of a judge family (`reward.judge_families`) is scored by the service's LLM judge
instead (`rollart_hpc.reward.judge`): one built-in engine that batches the judge requests of all
clients; `admit` then also counts the judge's slots. Every reply of a scored request is appended to the
results journal in the service dir first, so a restarted service answers a retried request from it
instead of scoring it again.
Who waits on whom: nothing blocks the loop (zmq.asyncio); reward calls run in the pool's workers.
Invariant: each (client, id) is scored at most once (see scheduler); every well-formed request gets
exactly one reply per send; stats.json (written atomically each `stats_every_s`) and the address file
say what the service is doing and where it listens.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from rollart_hpc.config.derive import derive
from rollart_hpc.config.schema import RewardConfig
from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.reward.functions import RewardInput
from rollart_hpc.reward.judge import Judge, JudgeResult
from rollart_hpc.reward.pool import RewardPool, RewardPoolConfig
from rollart_hpc.reward.scheduler import FairScheduler, Key
from rollart_hpc.reward.wire import (
    ADDRESS_FILE,
    RESULTS_FILE,
    STATS_FILE,
    BadRequestError,
    decode,
    encode,
    input_from_dict,
    write_service_files,
)

POOL_FROM_SECTION = derive(
    RewardPoolConfig, RewardConfig, given=("fn_for_family", "python_path", "fault_seed")
)
"""The pool's limits are the [reward] section's fields of the same name."""


def pool_config(
    cfg: RewardConfig, seed: int = 0, defaults: dict[str, str] | None = None, python_path: Sequence[str] = ()
) -> RewardPoolConfig:
    """The pool of `cfg` (`POOL_FROM_SECTION`); `defaults`: reward functions of families absent from
    `cfg.functions`."""
    return POOL_FROM_SECTION(
        cfg,
        fn_for_family={**(defaults or {}), **cfg.functions},
        python_path=tuple(python_path),
        fault_seed=seed,
    )


class RewardService:
    def __init__(
        self,
        cfg: RewardConfig,
        service_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        idle_exit_s: float = 0.0,
    ) -> None:
        self.cfg, self.dir = cfg, service_dir
        self.idle_exit_s = idle_exit_s  # > 0: stop after this long with no request and no work
        self.pool = RewardPool(pool_config(cfg))
        self.judge = make_judge(cfg)
        self.sched = FairScheduler(quota=cfg.service_quota)
        self.admit = cfg.max_workers + cfg.scale_up_queue - 1 + (cfg.judge_num_slots if self.judge else 0)
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 16 * cfg.service_max_request_bytes)  # beyond: dropped by zmq
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._load_journal()
        self._journal = (self.dir / RESULTS_FILE).open("a")
        self.token = write_service_files(self.dir, self.address)
        self.started = self.last_busy = time.monotonic()
        self.bad_requests = 0
        self.scoring: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()

    def _load_journal(self) -> None:
        path = self.dir / RESULTS_FILE
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    self.sched.remember((str(row["client"]), str(row["reply"]["id"])), dict(row["reply"]))
                except (json.JSONDecodeError, KeyError, TypeError):  # a line cut by a kill mid-write
                    continue

    # --- receiving ------------------------------------------------------------------------------------

    async def receive_loop(self) -> None:
        while not self._stop.is_set():
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                self.bad_requests += 1
                await self._reply(
                    frames[0],
                    {
                        "id": None,
                        "status": "error",
                        "retry": False,
                        "error": "malformed request: expected one frame",
                    },
                )
                continue
            peer, frame = frames
            try:
                reply = self.handle(peer, frame)
            except BadRequestError as exc:
                self.bad_requests += 1
                rid = _peek_id(frame) if len(frame) <= self.cfg.service_max_request_bytes else None
                reply = {"id": rid, "status": "error", "retry": False, "error": str(exc)}
            if reply is not None:
                await self._reply(peer, reply)

    def handle(self, peer: Hashable, frame: bytes) -> dict[str, Any] | None:
        """The immediate reply to one request, or None when it was queued for scoring."""
        self.last_busy = time.monotonic()
        msg = decode(frame, self.cfg.service_max_request_bytes)
        if not hmac.compare_digest(str(msg.get("token", "")).encode(), self.token.encode()):
            raise BadRequestError("unauthorized: wrong or missing token")
        op, rid = msg.get("op"), msg.get("id")
        if op == "ping":
            return {"id": rid, "status": "ok"}
        if op == "stats":
            return {"id": rid, "status": "ok", "stats": self.stats()}
        if op != "score":
            raise BadRequestError(f"malformed request: unknown op {op!r}")
        client = msg.get("client")
        if not isinstance(client, str) or not client or not isinstance(rid, str) or not rid:
            raise BadRequestError("malformed request: 'client' and 'id' must be non-empty strings")
        reply = self.sched.submit(peer, client, rid, input_from_dict(msg.get("input")))
        self._wake.set()
        return reply

    async def _reply(self, peer: bytes, reply: dict[str, Any]) -> None:
        await self.sock.send_multipart([peer, encode(reply)])

    # --- scoring --------------------------------------------------------------------------------------

    async def dispatch_loop(self) -> None:
        while not self._stop.is_set():
            while len(self.scoring) < self.admit and (item := self.sched.next()) is not None:
                task = asyncio.create_task(self._score(*item))
                self.scoring.add(task)
                task.add_done_callback(self._done)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.1)
            except TimeoutError:
                pass
            self.pool.maybe_scale_down()
            if self.idle_expired():
                self.stop()

    def idle_expired(self) -> bool:
        """With `idle_exit_s`: no request for that long and nothing queued or being scored."""
        idle_s = time.monotonic() - self.last_busy
        return 0 < self.idle_exit_s <= idle_s and not self.scoring and not self.sched.queued()

    def _done(self, task: asyncio.Task[None]) -> None:
        self.scoring.discard(task)
        self.last_busy = time.monotonic()
        self._wake.set()

    async def _score(self, key: Key, inp: RewardInput) -> None:
        errors: list[str] = []
        judged: JudgeResult | None = None
        if self.judge is not None and inp.family in self.judge.families:
            judged = await self._judge(inp, errors)
            out = None if judged is None else judged.output
        else:
            out = await self.pool.score_input(inp, errors)
        if out is None:
            reply: dict[str, Any] = {
                "id": key[1],
                "status": "failed",
                "error": f"scoring failed {len(errors)} times: {errors[-1]}",
            }
        else:
            reply = {
                "id": key[1],
                "status": "ok",
                "reward": out.reward,
                "success": out.success,
                "cached": False,
            }
            if judged is not None:
                reply["judge_fallback"] = judged.fallback
        self._journal.write(json.dumps({"client": key[0], "reply": reply}) + "\n")
        self._journal.flush()
        for peer in self.sched.complete(key, reply):
            await self._reply(peer, reply)  # type: ignore[arg-type]

    async def _judge(self, inp: RewardInput, errors: list[str]) -> JudgeResult | None:
        """The judge's result, retried like a reward call (`max_score_attempts`); None if all raised."""
        assert self.judge is not None
        for _ in range(self.cfg.max_score_attempts):
            try:
                return await self.judge.score(inp)
            except Exception as exc:  # a crashed judge engine: retried, then the request fails
                errors.append(repr(exc))
        return None

    # --- lifecycle ------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "uptime_s": time.monotonic() - self.started,
            "queued": self.sched.queued(),
            "scoring": len(self.scoring),
            "bad_requests": self.bad_requests,
            "clients": {c: vars(n) for c, n in self.sched.counts.items()},
            "pool": self.pool.stats(),
            **({"judge": self.judge.stats()} if self.judge is not None else {}),
        }

    async def stats_loop(self, every_s: float) -> None:
        while not self._stop.is_set():
            atomic_write_json(self.dir / STATS_FILE, self.stats())
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=every_s)
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()

    async def run(self, stats_every_s: float = 1.0) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        tasks = [
            asyncio.create_task(c)
            for c in (self.receive_loop(), self.dispatch_loop(), self.stats_loop(stats_every_s))
        ]
        try:
            await self._stop.wait()
        finally:
            for task in [*tasks, *self.scoring]:
                task.cancel()
            await asyncio.gather(*tasks, *self.scoring, return_exceptions=True)
            self.close()

    def close(self) -> None:
        (self.dir / ADDRESS_FILE).unlink(missing_ok=True)
        self.pool.close()
        if self.judge is not None:
            self.judge.close()
        atomic_write_json(self.dir / STATS_FILE, self.stats())
        self._journal.close()
        self.ctx.destroy(linger=0)


def make_judge(cfg: RewardConfig) -> Judge | None:
    """The service's LLM judge (`reward.judge_model`), or None without one."""
    if not cfg.judge_model:
        return None
    return Judge.load(
        Path(cfg.judge_model),
        cfg.judge_families,
        cfg.judge_max_new_tokens,
        cfg.judge_temperature,
        cfg.judge_num_slots,
    )


def _peek_id(frame: bytes) -> Any:
    """The id of a refused request if it can be read (so the client can match the error), else None."""
    try:
        msg = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return msg.get("id") if isinstance(msg, dict) else None
