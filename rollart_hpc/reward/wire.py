"""The reward service's wire format and files, shared by the service and its clients. No zmq here.

Messages are one JSON frame each way (a client's DEALER socket to the service's ROUTER socket).
Request: {"op": "score" | "ping" | "stats", "token", "client" (a run), "id" (unique within the client),
"input" (a `RewardInput` as a dict, for "score")}. Reply: {"id", "status", ...} where status is "ok"
(with "reward", "success", "cached"; a judge family's reply also "judge_fallback": true when the
judge's answer could not be parsed and the family's rule-based reward stands in), "failed" (every
reward call raised: "error"), or "error" (the request was refused: "error" says why, "retry" whether
sending it again later can succeed).
Files in the service dir: `address` (JSON: address, pid, started), written atomically; `token` (the
shared secret), mode 0600, written before `address` so a client that sees the address finds the token.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rollart_hpc.contracts.atomic import atomic_write_bytes
from rollart_hpc.reward.functions import RewardInput

ADDRESS_FILE = "address"
TOKEN_FILE = "token"
STATS_FILE = "stats.json"
RESULTS_FILE = "results.jsonl"
TOKEN_ENV = "ROLLART_REWARD_TOKEN"


class BadRequestError(ValueError):
    """A request the service refuses (malformed, oversized, unknown op); its text goes to the client."""


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(frame: bytes, max_bytes: int) -> dict[str, Any]:
    if len(frame) > max_bytes:
        raise BadRequestError(f"request too large: {len(frame)} bytes > limit {max_bytes}")
    try:
        message = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestError(f"malformed request: not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise BadRequestError("malformed request: not a JSON object")
    return message


def input_to_dict(inp: RewardInput) -> dict[str, Any]:
    return {**asdict(inp), "actions": list(inp.actions)}


def input_from_dict(data: Any) -> RewardInput:
    """A `RewardInput` from a request's "input", or BadRequestError naming what is wrong."""
    try:
        inp = RewardInput(
            str(data["task_id"]),
            str(data["family"]),
            tuple(str(a) for a in data["actions"]),
            float(data["env_return"]),
            bool(data["env_won"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequestError(f"malformed request: bad input ({exc!r})") from None
    return inp


def write_service_files(service_dir: Path, address: str) -> str:
    """Write a new token (0600) and then the address file; returns the token."""
    service_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(32)
    tmp = service_dir / f".{TOKEN_FILE}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, service_dir / TOKEN_FILE)
    info = {"address": address, "pid": os.getpid(), "started": time.time()}
    atomic_write_bytes(service_dir / ADDRESS_FILE, json.dumps(info).encode())
    return token


def read_endpoint(service: str, service_dir: str) -> tuple[str, str]:
    """(zmq address, token) a client uses: from the service dir's files, or `host:port` and the token in
    $ROLLART_REWARD_TOKEN. Raises FileNotFoundError while the service has not written its files."""
    if service_dir:
        folder = Path(service_dir)
        address = json.loads((folder / ADDRESS_FILE).read_text())["address"]
        return str(address), (folder / TOKEN_FILE).read_text().strip()
    return f"tcp://{service}", os.environ.get(TOKEN_ENV, "")
