"""The env child process: hosts env instances and answers reset/step requests over a pipe.

Protocol (parent -> child, one request at a time, each answered once):
- ("reset", FamilySpec, task_id, episode_id) -> ("ok", observation)
- ("step", action_text, step_index)          -> ("ok", (observation, reward, done, info))
- ("close",)                                 -> the child closes its envs and exits 0
Any exception raised by an env becomes ("error", "Type: message"), and the env that raised it is
dropped (a fresh one is built on the next reset). Injected faults (`FaultConfig`) run before the step:
a crash is `os._exit(CRASH_EXIT_CODE)`, a hang sleeps until the parent kills the child.
The child ignores SIGINT so that Ctrl-C reaches the parent alone, which then kills it by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

from rollart_hpc.envs.faults import FaultConfig, plan_step
from rollart_hpc.tasks.registry import FamilySpec
from rollart_hpc.tasks.types import Env

CRASH_EXIT_CODE = 70


class InjectedError(RuntimeError):
    """The exception an injected "error" fault raises inside a step."""


class _Host:
    """The envs of one child, one per family spec, plus the current episode."""

    def __init__(self, faults: FaultConfig) -> None:
        self.faults = faults
        self.envs: dict[FamilySpec, Env] = {}
        self.current: FamilySpec | None = None
        self.episode_id = ""

    def reset(self, spec: FamilySpec, task_id: str, episode_id: str) -> str:
        if spec not in self.envs:
            self.envs[spec] = spec.build().make_env()
        self.current, self.episode_id = spec, episode_id
        return self.envs[spec].reset(task_id)

    def step(self, action: str, step_index: int) -> tuple[str, float, bool, dict[str, Any]]:
        if self.current is None or self.current not in self.envs:
            raise RuntimeError("step before reset")
        if self.faults.enabled:
            _inject(self.faults, self.episode_id, step_index)
        return self.envs[self.current].step(action)

    def drop_current(self) -> None:
        env = self.envs.pop(self.current, None) if self.current is not None else None
        self.current = None
        if env is not None:
            env.close()

    def close(self) -> None:
        for env in self.envs.values():
            env.close()
        self.envs.clear()


def _inject(faults: FaultConfig, episode_id: str, step_index: int) -> None:
    fault = plan_step(faults, episode_id, step_index)
    if fault.kind == "crash":
        os._exit(CRASH_EXIT_CODE)
    if fault.kind == "hang":
        while True:
            time.sleep(3600)
    if fault.delay_s > 0:
        time.sleep(fault.delay_s)
    if fault.kind == "error":
        raise InjectedError(f"injected error at step {step_index} of {episode_id}")


def child_main(conn: Connection, faults: FaultConfig) -> None:
    """Serve requests on `conn` until "close" or the parent's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A private working directory: whatever an env writes relative to its cwd stays out of the caller's.
    workdir = tempfile.mkdtemp(prefix="rollart-env-")
    os.chdir(workdir)
    host = _Host(faults)
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg[0] == "close":
                return
            conn.send(_answer(host, msg))
    finally:
        host.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _answer(host: _Host, msg: tuple) -> tuple[str, Any]:
    try:
        if msg[0] == "reset":
            return "ok", host.reset(msg[1], msg[2], msg[3])
        if msg[0] == "step":
            return "ok", host.step(msg[1], msg[2])
        return "error", f"unknown request {msg[0]!r}"
    except Exception as exc:  # the process boundary: every env failure becomes an "error" answer
        host.drop_current()
        return "error", f"{type(exc).__name__}: {exc}"
