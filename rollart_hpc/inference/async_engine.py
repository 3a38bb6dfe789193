"""An asyncio front for an `Engine` (`rollart_hpc.inference.api`) implementing the `LLMClient` protocol.

Dataflow: callers on an event loop `await generate(...)`; the call registers a future (on the loop's
thread only) and puts an "add" command on a thread-safe queue. One background thread owns the engine:
it drains commands, calls `engine.step()` while there is work (or staged weights), and hands each
finished output back to its caller's loop with `call_soon_threadsafe`. Many concurrent `generate`
calls therefore share one continuously batched engine.

Who waits on whom: callers wait on their futures; the engine thread waits on a condition variable
when idle, woken by every command and by `update_weights`. Nothing else touches the engine, except
`update_weights`, which the engine makes thread-safe (it stages; the swap happens between steps).

Invariants: every `generate` call ends with exactly one result, an exception, or (when the caller is
cancelled) an abort of its request; a crash of the engine thread fails every pending and later call
with that error instead of hanging them.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterable
from typing import Any

from rollart_hpc.contracts.generation import RequestOutput, SamplingParams
from rollart_hpc.inference.api import Engine


class AsyncEngine:
    """Steps an `Engine` in a background thread; `generate` and `abort` are awaitable."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: deque[tuple[str, tuple[Any, ...]]] = deque()
        self._wake = threading.Condition()
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[RequestOutput]]] = {}
        self._futures_lock = threading.Lock()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> RequestOutput:
        """Run one request to completion (or error/abort) and return its output."""
        self._raise_if_failed()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RequestOutput] = loop.create_future()
        with self._futures_lock:
            if request_id in self._futures:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._futures[request_id] = (loop, future)
        self._command("add", request_id, list(prompt_token_ids), sampling)
        try:
            return await future
        except asyncio.CancelledError:
            self._command("abort", request_id)
            raise

    async def abort(self, request_id: str) -> None:
        """Abort a request; its `generate` call returns the tokens so far with finish_reason "abort"."""
        self._command("abort", request_id)

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Stage new weights (blocking while they are packed; generation continues) and wake the engine."""
        self.engine.update_weights(named_tensors, version)
        with self._wake:
            self._wake.notify()

    async def wait_for_version(self, version: int, poll_s: float = 0.005) -> None:
        """Return once the engine runs at `version` (after the staged weights were swapped in)."""
        while self.engine.version != version:
            self._raise_if_failed()
            await asyncio.sleep(poll_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread; pending calls fail with RuntimeError."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"engine thread did not stop within {timeout_s} s")
        self._fail_all(RuntimeError("engine closed"))

    # ----- engine thread -----
    def _command(self, kind: str, *args: Any) -> None:
        with self._wake:
            self._commands.append((kind, args))
            self._wake.notify()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"rollout engine failed: {self._error!r}") from self._error
        if self._stopping:
            raise RuntimeError("engine closed")

    def _loop(self) -> None:
        try:
            while self._next_commands():
                for out in self.engine.step():
                    if out.finished:
                        self._resolve(out)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting caller, then re-raised
            self._error = exc
            self._fail_all(exc)
            raise

    def _next_commands(self) -> bool:
        """Wait for work; apply queued commands. False once stopping."""
        with self._wake:
            while not (self._stopping or self._commands or self._has_work()):
                self._wake.wait()
            if self._stopping:
                return False
            commands, self._commands = list(self._commands), deque()
        for kind, args in commands:
            if kind == "add":
                self._add(*args)
            else:
                self.engine.abort(*args)
        return True

    def _add(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, prompt_token_ids, sampling)
        except ValueError as exc:
            with self._futures_lock:
                entry = self._futures.pop(request_id, None)
            if entry is not None:
                entry[0].call_soon_threadsafe(_set_exception, entry[1], exc)

    def _has_work(self) -> bool:
        return self.engine.has_unfinished() or self.engine.has_staged_weights()

    def _resolve(self, out: RequestOutput) -> None:
        with self._futures_lock:
            entry = self._futures.pop(out.request_id, None)
        if entry is None:
            return
        loop, future = entry
        loop.call_soon_threadsafe(_set_result, future, out)

    def _fail_all(self, exc: BaseException) -> None:
        with self._futures_lock:
            entries, self._futures = list(self._futures.values()), {}
        for loop, future in entries:
            if not loop.is_closed():
                loop.call_soon_threadsafe(
                    _set_exception, future, RuntimeError(f"rollout engine stopped: {exc!r}")
                )


def _set_result(future: asyncio.Future[RequestOutput], out: RequestOutput) -> None:
    if not future.done():
        future.set_result(out)


def _set_exception(future: asyncio.Future[RequestOutput], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
