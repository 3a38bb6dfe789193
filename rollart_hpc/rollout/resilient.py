"""Engines replaced in place: `ResilientEngine` wraps a rollout rank's `Engine` and rebuilds it on failure.

Dataflow: the rank loop (`rollart_hpc.rollout.main.serve`) drives a `ResilientEngine` like any engine.
When the inner engine raises from `step`, `add_request`, `abort`, a weight landing (`begin_weights`) or
`update_weights` (for vLLM also when
its engine-core process died, which the adapter surfaces as an exception), the wrapper logs it, closes
the broken engine (best effort), builds a new one with `build()` (the start model) and installs the
newest weights it received: a landing (and `update_weights`) keeps a CPU copy of the last version's
tensors when rebuilds are allowed, so the new
engine runs at the version the old one had (or at the newer one it had staged), and the staleness
accounting stays right. Every request the broken engine held is answered by the next `step()` with a
finished output, finish_reason "error", which the agent loop ends as a failed episode (cause
"llm_error"). Held requests are failed, not re-issued: a re-run is not exact (sampled tokens depend on
the batch and the lost generator state) and a request that broke the engine would break the next one.

Who waits on whom: the rank loop thread steps, adds, aborts and rebuilds; the weights thread lands a
version (`begin_weights` .. `commit`) or calls `update_weights`. `_lock`, held from `begin_weights` to
the landing's `commit`/`abort`, serialises a landing with a rebuild, so weights received during a
rebuild go into the new engine, never into the closed one. A failure inside a landing (weights thread)
only marks the engine broken (the landing goes on keeping the tensors); the loop thread rebuilds at its
next call.

Invariants: every added request yields exactly one finished output (the engine's, or an "error" output
after a failure); `version` never goes backwards across a rebuild; each failure (of the engine or of
building its replacement) uses one of `max_rebuilds`; once they are spent the next failure raises
`EngineFailedError` and the rank ends as before.

Fault injection (tests and `launch.py chaos`): a `FaultInjector` fails `step()` at seeded random calls,
or at the next step with requests after `ENGINE_FAULT_SIGNAL` arrived (`arm_fault_signal`; the handler
only sets a flag, the loop thread raises).
"""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from rollart_hpc.contracts.generation import RequestOutput, SamplingParams
from rollart_hpc.inference.api import Engine, WeightLanding

if TYPE_CHECKING:
    import torch

NamedTensors = list[tuple[str, "torch.Tensor"]]


class EngineFailedError(RuntimeError):
    """The engine failed and no rebuild is left (or allowed)."""


# Sent to a rollout rank to fail its engine's next step (`launch.py chaos`, fault `engine`); a real-time
# signal, so it means nothing else to the rank (SIGUSR1/SIGUSR2/SIGTERM are stop requests).
ENGINE_FAULT_SIGNAL = signal.SIGRTMIN + 1


class InjectedEngineError(RuntimeError):
    """A failure injected into `step()` by `FaultInjector` (fault injection only)."""


class FaultInjector:
    """Raises `InjectedEngineError` with probability `prob` per call, at most `num_faults` times; the
    draws come from `random.Random(seed)`, so a run's faults depend only on the seed and the call count.
    After `trip()` the next call raises as well (outside the `num_faults` budget)."""

    def __init__(self, prob: float, num_faults: int, seed: int) -> None:
        self.prob, self.remaining = prob, num_faults
        self.rng = random.Random(f"engine-faults:{seed}")
        self.calls = 0
        self.tripped = False

    def trip(self) -> None:
        """Fail the next call; safe from a signal handler (it only sets a flag)."""
        self.tripped = True

    def check(self) -> None:
        self.calls += 1
        if self.tripped:
            self.tripped = False
            raise InjectedEngineError(f"engine failure requested by signal, at faulted step {self.calls}")
        if self.remaining > 0 and self.rng.random() < self.prob:
            self.remaining -= 1
            raise InjectedEngineError(f"injected engine failure at faulted step {self.calls}")


def arm_fault_signal(faults: FaultInjector) -> None:
    """`ENGINE_FAULT_SIGNAL` trips `faults` (main thread only, as for every signal handler)."""
    signal.signal(ENGINE_FAULT_SIGNAL, lambda signum, frame: faults.trip())


class ResilientEngine:
    """An `Engine` that replaces its inner engine when it fails (see the module docstring)."""

    def __init__(
        self,
        build: Callable[[], Engine],
        max_rebuilds: int,
        log: Callable[[str], None],
        faults: FaultInjector | None = None,
    ) -> None:
        self._build, self.max_rebuilds, self._log, self._faults = build, max_rebuilds, log, faults
        self.engine = build()
        self.failures = 0
        self.rebuilds = 0
        self._attempts = 0
        self._held: dict[str, list[int]] = {}  # request id -> prompt, while the inner engine holds it
        self._failed: list[RequestOutput] = []  # answers for the requests a broken engine held
        self._newest: tuple[NamedTensors, int] | None = None
        self._broken: BaseException | None = None
        self._lock = threading.RLock()

    # ----- Engine -----
    @property
    def version(self) -> int:
        return self.engine.version

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        self._recover_if_broken()
        if request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._held[request_id] = list(prompt_token_ids)
        try:
            self.engine.add_request(request_id, prompt_token_ids, sampling)
        except ValueError:
            del self._held[request_id]
            raise
        except Exception as exc:  # the engine broke: the held requests (this one too) fail
            self._recover(exc)

    def abort(self, request_id: str) -> bool:
        self._recover_if_broken()
        if request_id not in self._held:
            return False
        try:
            return self.engine.abort(request_id)
        except Exception as exc:
            self._recover(exc)
            return False

    def step(self) -> list[RequestOutput]:
        self._recover_if_broken()
        try:
            if self._faults is not None and self._held:
                self._faults.check()
            outputs = self.engine.step()
        except Exception as exc:
            self._recover(exc)
            outputs = []
        for out in outputs:
            if out.finished:
                self._held.pop(out.request_id, None)
        failed, self._failed = self._failed, []
        return failed + outputs

    def has_unfinished(self) -> bool:
        return bool(self._failed) or self._broken is not None or self.engine.has_unfinished()

    def has_staged_weights(self) -> bool:
        return self._broken is None and self.engine.has_staged_weights()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = list(named_tensors)
        with self._lock:
            if self.max_rebuilds > 0:
                self._newest = ([(name, t.detach().to("cpu", copy=True)) for name, t in named], version)
            if self._broken is not None:
                return  # the rebuild installs them
            try:
                self.engine.update_weights(named, version)
            except Exception as exc:
                self._broken = exc

    def begin_weights(self, version: int) -> _ResilientLanding:
        """The inner engine's landing, kept (a CPU copy of each landed tensor, when rebuilds are allowed)
        for a rebuild; a failure of the inner landing marks the engine broken and the landing goes on
        collecting, so the rebuild installs the version."""
        self._lock.acquire()
        inner = None
        if self._broken is None:
            try:
                inner = self.engine.begin_weights(version)
            except Exception as exc:
                self._broken = exc
        return _ResilientLanding(self, inner, version)

    def close(self) -> None:
        self.engine.close()

    # ----- recovery (rank loop thread) -----
    def _recover_if_broken(self) -> None:
        if self._broken is not None:
            self._recover(self._broken)

    def _recover(self, exc: BaseException) -> None:
        with self._lock:
            self._broken, old_version = None, self.engine.version
            self.failures += 1
            self._log(f"rollout engine failed ({exc!r}); failing {len(self._held)} held requests, rebuilding")
            self._fail_held(exc)
            _close_quietly(self.engine, self._log)
            while True:
                if self._attempts >= self.max_rebuilds:
                    raise EngineFailedError(
                        f"rollout engine failed {self.failures} times; rollout.max_engine_rebuilds = "
                        f"{self.max_rebuilds} spent: {exc!r}"
                    ) from exc
                self._attempts += 1
                try:
                    self.engine = self._rebuild(old_version)
                    break
                except Exception as build_exc:
                    self.failures += 1
                    self._log(f"rollout engine rebuild {self._attempts} failed: {build_exc!r}")
                    exc = build_exc
            self.rebuilds += 1
            self._log(f"rollout engine rebuilt ({self.rebuilds} so far) at version {self.engine.version}")

    def _fail_held(self, exc: BaseException) -> None:
        message = f"rollout engine failed and was replaced: {exc!r}"
        for request_id, prompt in self._held.items():
            self._failed.append(
                RequestOutput(request_id, prompt, finished=True, finish_reason="error", error=message)
            )
        self._held.clear()

    def _rebuild(self, old_version: int) -> Engine:
        engine = self._build()
        try:
            if self._newest is not None:
                named, version = self._newest
                engine.update_weights(named, version)
                for _ in range(1000):  # an idle engine swaps staged weights at its next step
                    if not engine.has_staged_weights():
                        break
                    engine.step()
            if engine.version < old_version:
                raise RuntimeError(f"rebuilt engine runs version {engine.version} < {old_version}")
        except Exception:
            _close_quietly(engine, self._log)
            raise
        return engine


class _ResilientLanding:
    """A landing through `ResilientEngine` (holds its lock from `begin_weights` to `commit`/`abort`)."""

    def __init__(self, owner: ResilientEngine, inner: WeightLanding | None, version: int) -> None:
        self.owner, self.inner, self.version = owner, inner, version
        self.kept: NamedTensors | None = [] if owner.max_rebuilds > 0 else None
        self._targets: Mapping[str, torch.Tensor] = inner.targets if inner is not None else {}

    @property
    def targets(self) -> Mapping[str, torch.Tensor]:
        return self._targets

    def land(self, named: NamedTensors) -> None:
        if self.kept is not None:
            self.kept += [(name, t.detach().to("cpu", copy=True)) for name, t in named]
        if self.inner is not None:
            try:
                self.inner.land(named)
            except Exception as exc:
                self._fail(exc)

    def commit(self, direct: Iterable[str] = ()) -> None:
        try:
            names = list(direct)
            if self.kept is not None:
                self.kept += [(name, self._targets[name].detach().to("cpu", copy=True)) for name in names]
                self.owner._newest = (self.kept, self.version)
            if self.inner is not None:
                try:
                    self.inner.commit(names)
                except Exception as exc:
                    self.inner = None
                    self.owner._broken = exc
        finally:
            self.owner._lock.release()

    def abort(self) -> None:
        try:
            if self.inner is not None:
                self.inner.abort()
        finally:
            self.owner._lock.release()

    def _fail(self, exc: Exception) -> None:
        assert self.inner is not None
        try:
            self.inner.abort()
        except Exception as abort_exc:  # the engine is broken already; the rebuild replaces it
            self.owner._log(f"aborting the failed weight landing v{self.version}: {abort_exc!r}")
        self.inner = None
        self.owner._broken = exc


def _close_quietly(engine: Engine, log: Callable[[str], None]) -> None:
    try:
        engine.close()
    except Exception as exc:  # best effort: the engine is broken already
        log(f"closing the broken rollout engine failed: {exc!r}")
