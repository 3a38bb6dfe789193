"""Per-task value trackers: SPO's Beta tracker and SPO++'s event-time tracker. Pure Python.

Both keep a Beta posterior (alpha, beta) per task id over terminal outcomes R in [0, 1] and serve the
baseline v_hat = alpha / (alpha + beta). The pipeline drives them with three calls, always from one thread
(the controller's event loop); a tracker is not thread-safe and needs no locks under that contract:

    d = tracker.dispatch(task_id)          # freeze v_hat at the current policy event -> Dispatch
    tracker.on_policy_event()              # one call per published policy version
    tracker.observe(task_id, reward, d.event)   # fold a result generated at policy event d.event

The advantage of a returning trajectory is `reward - d.baseline`: its own outcome never moves its own
baseline; it only updates the baseline of later dispatches.

- `EventTimeTracker` (SPO++, Eq. 3): the retention factor rho is fixed per policy event. A result generated
  at event z_i weighs rho^(z_now - z_i); the offline prior decays the same way from event 0. Sums are kept
  per task with the event they are scaled to and rescaled lazily on the next fold (v_hat is a ratio, so
  a common scale never changes it). Invariant (SPO++
  Remark 1): for a fixed set of folded results, the baseline of a dispatch does not depend on the order or
  the policy event at which those results arrived (up to floating-point rounding).
- `SPOTracker` (the SPO recipe): sequential updates in arrival order, alpha <- rho*alpha + R, with rho
  either constant or KL-adaptive, rho = clamp(2^(-D/D_half), rho_min, rho_max), where D is the caller's
  sample-based drift of the task's previous response (see `response_drift`); no drift (first visit) is
  D = 0, i.e. rho = rho_max.

Offline initialisation (`jeffreys_prior`): n0 outcomes with s successes give alpha_0 = m(s + 1/2)/(n0 + 1)
and beta_0 = m(n0 - s + 1/2)/(n0 + 1), total mass m = 8 by default; no outcomes give Beta(1/2, 1/2), as the
SPO recipe does for n0 = 0. State round-trips through `state_dict()` / `load_state_dict()` as plain
JSON-able values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

DEFAULT_PRIOR_MASS = 8.0


@dataclass(frozen=True)
class Dispatch:
    """A request's frozen view of its task: the policy event it was dispatched at and the baseline v_hat."""

    task_id: str
    event: int
    baseline: float


class ValueTracker(Protocol):
    """What the controller and the task sampler need from a tracker."""

    @property
    def event(self) -> int: ...

    def add_task(self, task_id: str, prior: tuple[float, float]) -> None: ...

    def value(self, task_id: str) -> float: ...

    def dispatch(self, task_id: str) -> Dispatch: ...

    def on_policy_event(self) -> None: ...

    def observe(self, task_id: str, reward: float, event: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def jeffreys_prior(outcomes: Sequence[float], mass: float = DEFAULT_PRIOR_MASS) -> tuple[float, float]:
    """(alpha_0, beta_0) from offline outcomes in [0, 1]: Jeffreys-smoothed mean with total mass `mass`.

    s is the sum of the outcomes (the success count for binary rewards). An empty list gives the Jeffreys
    prior Beta(1/2, 1/2) itself, as the SPO recipe does when no offline samples exist.
    """
    if mass <= 0:
        raise ValueError(f"prior mass must be > 0, got {mass}")
    for r in outcomes:
        _check_reward(r)
    n0 = len(outcomes)
    if n0 == 0:
        return 0.5, 0.5
    s = math.fsum(outcomes)
    return mass * (s + 0.5) / (n0 + 1), mass * (n0 - s + 0.5) / (n0 + 1)


def offline_priors(
    outcomes_by_task: Mapping[str, Sequence[float]], mass: float = DEFAULT_PRIOR_MASS
) -> dict[str, tuple[float, float]]:
    """`jeffreys_prior` of every task's offline outcomes, ready for a tracker's constructor."""
    return {task_id: jeffreys_prior(outcomes, mass) for task_id, outcomes in outcomes_by_task.items()}


def response_drift(stored_logprobs: Sequence[float], current_logprobs: Sequence[float]) -> float:
    """SPO's KL proxy D: mean |log pi_stored - log pi_now| over the action tokens of a task's previous response.

    Pass only action tokens (observation tokens removed). An empty response has no evidence of drift: 0.
    """
    if len(stored_logprobs) != len(current_logprobs):
        raise ValueError(f"drift needs equal lengths, got {len(stored_logprobs)} and {len(current_logprobs)}")
    if not stored_logprobs:
        return 0.0
    return math.fsum(abs(a - b) for a, b in zip(stored_logprobs, current_logprobs, strict=True)) / len(
        stored_logprobs
    )


def _check_reward(reward: float) -> None:
    if not 0.0 <= reward <= 1.0 or math.isnan(reward):
        raise ValueError(f"tracker rewards must lie in [0, 1], got {reward}")


def _check_rho(name: str, rho: float) -> None:
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {rho}")


@dataclass
class _Sums:
    """Evidence of one task: alpha and beta scaled to policy event `at` (their weight there is 1)."""

    alpha: float
    beta: float
    at: int


class _TrackerBase:
    """Task table, event counter, dispatch and serialisation shared by both trackers."""

    kind = ""

    def __init__(self, priors: Mapping[str, tuple[float, float]] | None = None) -> None:
        self._event = 0
        self._tasks: dict[str, _Sums] = {}
        for task_id, prior in (priors or {}).items():
            self.add_task(task_id, prior)

    @property
    def event(self) -> int:
        """The current policy event (number of published policy versions seen)."""
        return self._event

    @property
    def task_ids(self) -> Iterable[str]:
        return self._tasks.keys()

    def add_task(self, task_id: str, prior: tuple[float, float]) -> None:
        """Register a task with its offline evidence (alpha_0, beta_0), anchored at the current event."""
        if task_id in self._tasks:
            raise ValueError(f"task {task_id!r} is already tracked")
        alpha, beta = prior
        if alpha < 0 or beta < 0 or alpha + beta <= 0:
            raise ValueError(
                f"prior of task {task_id!r} needs alpha, beta >= 0 with positive mass, got {prior}"
            )
        self._tasks[task_id] = _Sums(float(alpha), float(beta), self._event)

    def _sums(self, task_id: str) -> _Sums:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise KeyError(f"task {task_id!r} is not tracked; add_task() it first") from None

    def value(self, task_id: str) -> float:
        """The current baseline v_hat = alpha / (alpha + beta); a common rescale does not change it."""
        s = self._sums(task_id)
        return s.alpha / (s.alpha + s.beta)

    def dispatch(self, task_id: str) -> Dispatch:
        return Dispatch(task_id, self._event, self.value(task_id))

    def on_policy_event(self) -> None:
        self._event += 1

    def _check_event(self, event: int) -> None:
        if not 0 <= event <= self._event:
            raise ValueError(
                f"result generated at policy event {event}, but the current event is {self._event}"
            )

    def _params(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "params": self._params(),
            "event": self._event,
            "tasks": {k: [s.alpha, s.beta, s.at] for k, s in self._tasks.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`; the tracker's kind and parameters must match the saved ones."""
        if state["kind"] != self.kind or dict(state["params"]) != self._params():
            raise ValueError(
                f"checkpoint holds a {state['kind']!r} tracker with {dict(state['params'])}, "
                f"this is a {self.kind!r} tracker with {self._params()}"
            )
        self._event = int(state["event"])
        self._tasks = {k: _Sums(float(a), float(b), int(at)) for k, (a, b, at) in state["tasks"].items()}


class EventTimeTracker(_TrackerBase):
    """SPO++ event-time tracker (Eq. 3): results weigh rho^(events since they were generated)."""

    kind = "event_time"

    def __init__(self, priors: Mapping[str, tuple[float, float]] | None = None, rho: float = 0.875) -> None:
        _check_rho("rho", rho)
        self.rho = float(rho)
        super().__init__(priors)

    def _params(self) -> dict[str, Any]:
        return {"rho": self.rho}

    def effective_mass(self, task_id: str) -> float:
        """N_eff = alpha + beta at the current event."""
        s = self._sums(task_id)
        return (s.alpha + s.beta) * self.rho ** (self._event - s.at)

    def observe(self, task_id: str, reward: float, event: int) -> None:
        """Fold a result generated at policy `event` with weight rho^(current event - event)."""
        _check_reward(reward)
        self._check_event(event)
        s = self._sums(task_id)
        # Scale to the newer of the two evidences so one weight is 1: nothing underflows to 0/0.
        at = max(s.at, event)
        decay = self.rho ** (at - s.at)
        weight = self.rho ** (at - event)
        s.alpha = s.alpha * decay + weight * reward
        s.beta = s.beta * decay + weight * (1.0 - reward)
        s.at = at


@dataclass(frozen=True)
class SPORho:
    """SPO's retention: constant, or KL-adaptive rho = clamp(2^(-D/d_half), rho_min, rho_max)."""

    mode: str = "kl"
    constant: float = 0.96
    d_half: float = 0.06
    rho_min: float = 0.875
    rho_max: float = 0.96

    def __post_init__(self) -> None:
        if self.mode not in ("kl", "constant"):
            raise ValueError(f"SPO rho mode must be 'kl' or 'constant', got {self.mode!r}")
        _check_rho("rho constant", self.constant)
        _check_rho("rho_min", self.rho_min)
        _check_rho("rho_max", self.rho_max)
        if self.rho_min > self.rho_max or self.d_half <= 0:
            raise ValueError(f"SPO rho needs rho_min <= rho_max and d_half > 0, got {self}")

    def __call__(self, drift: float | None) -> float:
        """rho for one update; drift None (first visit) counts as D = 0."""
        if self.mode == "constant":
            return self.constant
        d = 0.0 if drift is None else drift
        if d < 0:
            raise ValueError(f"drift must be >= 0, got {d}")
        return min(max(2.0 ** (-d / self.d_half), self.rho_min), self.rho_max)


class SPOTracker(_TrackerBase):
    """SPO recipe tracker: alpha <- rho*alpha + R, beta <- rho*beta + (1 - R), in arrival order."""

    kind = "spo"

    def __init__(
        self, priors: Mapping[str, tuple[float, float]] | None = None, rho: SPORho | None = None
    ) -> None:
        self.rho = rho if rho is not None else SPORho()
        super().__init__(priors)

    def _params(self) -> dict[str, Any]:
        return dataclasses.asdict(self.rho)

    def effective_mass(self, task_id: str) -> float:
        s = self._sums(task_id)
        return s.alpha + s.beta

    def observe(self, task_id: str, reward: float, event: int, drift: float | None = None) -> None:
        """Fold one result in arrival order; `drift` is `response_drift` of the task's previous response."""
        _check_reward(reward)
        self._check_event(event)
        s = self._sums(task_id)
        rho = self.rho(drift)
        s.alpha = rho * s.alpha + reward
        s.beta = rho * s.beta + (1.0 - reward)
        s.at = self._event


TRACKERS: dict[str, type[EventTimeTracker] | type[SPOTracker]] = {
    "event_time": EventTimeTracker,
    "spo": SPOTracker,
}
