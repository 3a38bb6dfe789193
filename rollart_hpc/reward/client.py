"""A reward rank's client of the reward service: forwards each trajectory's reward input and waits for
the score, with timeouts, retries with backoff and a deadline.

Dataflow: `score(traj)` sends a "score" request on a zmq DEALER socket, its id the episode id plus a
digest of the reward input (a resend is idempotent at the service, see `request_id`); one receive task
resolves the waiting future by id. No reply within the attempt's timeout (`service_timeout_s`, doubling up to 8x): the
endpoint is read again (a restarted service may listen elsewhere, with a new token) and the request is
sent again. A refusal that may pass later (quota full; a token that a restart rotated) is retried after
a backoff. Past `service_deadline_s` the trajectory is returned failed, cause "reward_unavailable";
a request the service refused for good, or could not score, is returned failed, cause "reward_error".
Start on demand: with `service_dir` holding a `launch.json` (`launch.py reward-service --slurm`), a
client that finds no address file, or gets no reply within an attempt's timeout, calls
`ondemand.ensure_started` (at most once per `service_timeout_s`, in a thread: squeue and sbatch block),
which resubmits the service's job unless one is pending or running; the client then waits for the address
file within its normal retries and deadline.
Invariant: each call of `score` returns its trajectory exactly once, scored or failed with a cause;
never trained unscored.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from rollart_hpc.config.schema import RewardConfig
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.reward import ondemand
from rollart_hpc.reward.functions import RewardInput
from rollart_hpc.reward.wire import encode, input_to_dict, read_endpoint

UNAVAILABLE = "reward_unavailable"


def request_id(episode_id: str, inp: dict[str, Any]) -> str:
    """The episode id and a digest of what is scored: a resend is the same request; an episode dispatched
    again after a restart (same id, other actions) is a new one, never answered with the old score."""
    digest = hashlib.sha256(json.dumps(inp, sort_keys=True).encode()).hexdigest()[:16]
    return f"{episode_id}:{digest}"


class ServiceClient:
    def __init__(self, cfg: RewardConfig, client: str) -> None:
        self.cfg, self.client = cfg, client
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None
        self.address, self.token = "", ""
        self.futures: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._receiver: asyncio.Task[None] | None = None
        self.counts = {
            "requests": 0,
            "retries": 0,
            "reconnects": 0,
            "cached": 0,
            "refused": 0,
            "unavailable": 0,
            "errors": 0,
            "starts": 0,
        }
        self.reply_s: list[float] = []
        self.start_error = ""
        self._next_start_check = 0.0

    # --- connection -----------------------------------------------------------------------------------

    def _connect(self) -> bool:
        """(Re)read the endpoint; reconnect when the address changed. False while there is none."""
        try:
            address, token = read_endpoint(self.cfg.service, self.cfg.service_dir)
        except (OSError, ValueError, KeyError):
            self._close_socket()  # gone (an idle exit removes the address): wait for a new one
            return False
        self.token = token
        if address != self.address or self.sock is None:
            self._close_socket()
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(address)
            self.counts["reconnects"] += int(bool(self.address))  # not the first connect
            self.address = address
            self._receiver = asyncio.create_task(self._receive(self.sock))
        return True

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frame = await sock.recv()
            try:
                msg = json.loads(frame)
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            fut = self.futures.get(str(msg.get("id"))) if isinstance(msg, dict) else None
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _close_socket(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            self._receiver = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def close(self) -> None:
        self._close_socket()
        self.ctx.destroy(linger=0)

    # --- requests -------------------------------------------------------------------------------------

    async def score(self, traj: Trajectory) -> Trajectory:
        if traj.status != "ok":
            traj.reward, traj.success = 0.0, False
            return traj
        inp = input_to_dict(RewardInput.of(traj))
        reply = await self.request(request_id(traj.episode_id, inp), inp)
        if reply["status"] == "ok":
            traj.reward, traj.success = float(reply["reward"]), bool(reply["success"])
            return traj
        cause = UNAVAILABLE if reply["status"] == "unavailable" else "reward_error"
        traj.status, traj.finish_cause, traj.error = "failed", cause, str(reply.get("error", ""))
        traj.reward, traj.success = 0.0, False
        return traj

    async def request(self, rid: str, inp: dict[str, Any]) -> dict[str, Any]:
        """The service's reply ("ok" or "failed"), a refusal ("error"), or status "unavailable" when no
        answer came before the deadline."""
        self.counts["requests"] += 1
        start = time.monotonic()
        deadline = start + self.cfg.service_deadline_s
        attempt = 0
        while (remaining := deadline - time.monotonic()) > 0:
            if attempt:
                self.counts["retries"] += 1
            wait = min(self.cfg.service_timeout_s * 2 ** min(attempt, 3), remaining)
            attempt += 1
            reply = await self._attempt(rid, inp, wait) if self._connect() else None
            if reply is None:
                await self._start_on_demand()
                if self.sock is None:  # no endpoint yet: the service is (re)starting
                    await asyncio.sleep(min(0.05 * 2**attempt, 1.0, max(remaining, 0.0)))
                continue
            if reply["status"] in ("ok", "failed"):
                self.counts["cached"] += int(bool(reply.get("cached")))
                self.reply_s.append(time.monotonic() - start)
                return reply
            if reply.get("retry") or (self.cfg.service_dir and "unauthorized" in str(reply.get("error"))):
                self.counts["refused"] += 1
                await asyncio.sleep(min(0.05 * 2**attempt, 2.0, max(remaining, 0.0)))
                continue
            self.counts["errors"] += 1
            return reply
        self.counts["unavailable"] += 1
        error = f"no reply from the reward service at {self.address or '?'} within {self.cfg.service_deadline_s:g}s"
        return {"id": rid, "status": "unavailable", "error": f"{error} ({attempt} attempts)"}

    async def _start_on_demand(self) -> None:
        """Resubmit the service's job when it can be started on demand (see the module docstring)."""
        folder = Path(self.cfg.service_dir) if self.cfg.service_dir else None
        if folder is None or time.monotonic() < self._next_start_check or not ondemand.can_start(folder):
            return
        self._next_start_check = time.monotonic() + self.cfg.service_timeout_s
        try:
            job_id = await asyncio.to_thread(ondemand.ensure_started, folder, self.client)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            self.start_error = str(exc)  # tried again at the next check; the deadline bounds the wait
            return
        self.counts["starts"] += int(job_id is not None)

    async def _attempt(self, rid: str, inp: dict[str, Any], wait: float) -> dict[str, Any] | None:
        assert self.sock is not None
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.futures[rid] = fut
        msg = {"op": "score", "token": self.token, "client": self.client, "id": rid, "input": inp}
        try:
            await asyncio.wait_for(self.sock.send(encode(msg)), timeout=wait)
            return await asyncio.wait_for(fut, timeout=wait)
        except TimeoutError:
            return None
        finally:
            self.futures.pop(rid, None)

    def rank_counts(self) -> tuple[int, int]:
        """(requests that failed, reconnects), what a reward rank reports in its STATS."""
        return self.counts["unavailable"] + self.counts["errors"], self.counts["reconnects"]

    def stats(self) -> dict[str, Any]:
        lat = sorted(self.reply_s)
        return {
            **self.counts,
            "reply_s_mean": sum(lat) / len(lat) if lat else 0.0,
            "reply_s_p95": lat[int(0.95 * (len(lat) - 1))] if lat else 0.0,
        }
