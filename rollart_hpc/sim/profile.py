"""A run's cost profile for the scale simulator, calibrated from its controller trace (`metrics.trace`).

What is measured, and how:
- Episodes: each training episode's shape, replayed as measured: reset time, and per turn the new prompt
  tokens, the generated tokens and the env step time; plus `post_s`, the time from its last env step to
  the controller (reward scoring and messages).
- Rollout engine: one decode step of a continuous-batching engine with b requests costs
  `decode_s + decode_s_per_request * b`, and a request's prompt tokens cost `prefill_s_per_token` in the
  step it joins. The three are fitted by least squares (non-negative) to every turn's measured `llm_s`
  against its prompt tokens q, generated tokens k and k * b, where b is the mean number of requests the
  same engine had in flight during that turn (rebuilt from the trace: an episode's turns follow one
  another from its dispatch). Queueing for an engine slot and the prefill of requests joining a step also
  land in a turn's `llm_s`, so the fit only gives the shape: `sim.model.refine` then scales the three so
  that the simulated run's mean turn time equals the measured one.
- Trainer: the time from handing a step to the trainers to its published result, fitted as
  `train_s + train_s_per_token * tokens` over the run's steps (the mean when the fit is degenerate).
- Weight swap: the time from a step's result to the last rollout rank having loaded its version.
- Checkpoints: their durations; the controller handles no message while it writes one, so the part of an
  episode's `post_s` spent waiting for a checkpoint is not counted in it.

On a shared box every role's time includes the contention of the others; the fit absorbs the run's mean.
A profile is therefore a description of one machine and one model: projections to other hardware scale
its engine and trainer costs by stated factors (`sim.model.Scenario`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.metrics.trace import TRACE_FILE
from rollart_hpc.routing.router import rollout_index


@dataclass(frozen=True)
class EpisodeShape:
    reset_s: float
    prompt: tuple[int, ...]
    gen: tuple[int, ...]
    env_s: tuple[float, ...]
    post_s: float
    tokens: int  # the trajectory's length, what the trainer pays for
    failed: bool = False
    family: str = ""  # the task family (synthetic workloads route by it; measured shapes leave it empty)


@dataclass(frozen=True)
class Profile:
    episodes: tuple[EpisodeShape, ...]
    decode_s: float
    decode_s_per_request: float
    prefill_s_per_token: float
    train_s: float
    train_s_per_token: float
    swap_s: tuple[float, ...]
    checkpoint_s: tuple[float, ...] = (0.0,)
    fit: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The fitted costs without the episode list."""
        return {k: v for k, v in asdict(self).items() if k != "episodes"} | {"episodes": len(self.episodes)}


def steady_step_s(trained_at: list[float]) -> float:
    """The mean time between published steps after the first (the pipeline's fill-up excluded)."""
    return (trained_at[-1] - trained_at[0]) / (len(trained_at) - 1)


@dataclass
class Measured:
    """What the run itself achieved, read from the same trace: the figures a prediction is checked on."""

    trajectories_per_s: float
    step_s: float
    steps: int
    trained: int
    wall_s: float


def read_trace(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / TRACE_FILE
    if not path.is_file():
        raise UsageError(
            f"{path}: no controller trace (runs record it since the simulator exists); rerun the config"
        )
    events = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            events.append(json.loads(line))
        except ValueError:
            if number != len(path.read_text().splitlines()):  # a torn last line is a crash's, skip it
                raise UsageError(f"{path}:{number}: not a JSON line") from None
    starts = [i for i, e in enumerate(events) if e.get("e") == "start"]
    if not starts:
        raise UsageError(f"{path}: no 'start' event")
    if len(starts) > 1:
        raise UsageError(
            f"{path}: the run was resumed ({len(starts)} attempts); calibrate on an uninterrupted run"
        )
    return events


def measured(events: list[dict[str, Any]]) -> Measured:
    start = next(e["t"] for e in events if e["e"] == "start")
    batch_size = next(e["batch_size"] for e in events if e["e"] == "start")
    trained = sorted(e["t"] for e in events if e["e"] == "trained")
    if len(trained) < 2:
        raise UsageError(f"the trace has {len(trained)} trained steps; calibration needs at least 2")
    wall = trained[-1] - start
    return Measured(
        trajectories_per_s=len(trained) * batch_size / wall,
        step_s=steady_step_s(trained),
        steps=len(trained),
        trained=len(trained) * batch_size,
        wall_s=wall,
    )


def _overlap(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals)


def _episodes(
    results: list[dict[str, Any]], pauses: list[tuple[float, float]]
) -> tuple[list[EpisodeShape], list[dict[str, Any]]]:
    shapes, turns = [], []
    for r in results:
        t = r["dispatch_t"] + r["reset_s"]
        for q, k, llm, env in zip(r["prompt"], r["gen"], r["llm_s"], r["env_s"], strict=True):
            turns.append({"id": r["id"], "start": t, "end": t + llm, "q": q, "k": k, "llm_s": llm})
            t += llm + env
        shapes.append(
            EpisodeShape(
                reset_s=r["reset_s"],
                prompt=tuple(r["prompt"]),
                gen=tuple(r["gen"]),
                env_s=tuple(r["env_s"]),
                post_s=max(r["t"] - t - _overlap(t, r["t"], pauses), 0.0),
                tokens=int(r["tokens"]),
                failed=r["status"] != "ok",
            )
        )
    return shapes, turns


def _concurrency(turns: list[dict[str, Any]], num_rollouts: int) -> np.ndarray:
    """For each turn, the mean number of turns on the same engine in flight during it (itself included)."""
    b = np.ones(len(turns))
    by_engine: dict[int, list[int]] = {}
    for i, turn in enumerate(turns):
        by_engine.setdefault(rollout_index(turn["id"], num_rollouts), []).append(i)
    for members in by_engine.values():
        starts = np.array([turns[i]["start"] for i in members])
        ends = np.array([turns[i]["end"] for i in members])
        for j, i in enumerate(members):
            span = ends[j] - starts[j]
            if span <= 0:
                continue
            overlap = np.clip(np.minimum(ends, ends[j]) - np.maximum(starts, starts[j]), 0.0, None)
            b[i] = overlap.sum() / span
    return b


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative column and refit until none is."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def calibrate(run_dir: Path, num_rollouts: int) -> tuple[Profile, Measured]:
    """The profile of a finished run and what it measured (see the module docstring)."""
    events = read_trace(run_dir)
    results = [e for e in events if e["e"] == "result"]
    if not results:
        raise UsageError(f"{run_dir / TRACE_FILE}: no episode results to calibrate on")
    done = measured(events)
    checkpoints = [e for e in events if e["e"] == "checkpoint"]
    shapes, turns = _episodes(results, [(e["t"] - e["s"], e["t"]) for e in checkpoints])
    if not turns:
        raise UsageError(f"{run_dir / TRACE_FILE}: no episode finished a turn")
    b = _concurrency(turns, num_rollouts)
    q = np.array([t["q"] for t in turns], dtype=float)
    k = np.array([t["k"] for t in turns], dtype=float)
    y = np.array([t["llm_s"] for t in turns])
    decode_s, per_request, prefill = _nonneg_lstsq(np.stack([k, k * b, q], axis=1), y)
    pred = decode_s * k + per_request * k * b + prefill * q
    r2 = 1.0 - float(((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-12))

    batches = {e["step"]: e for e in events if e["e"] == "batch"}
    trained = {e["step"]: e for e in events if e["e"] == "trained"}
    steps = sorted(set(batches) & set(trained))
    tokens = np.array([batches[s]["tokens"] for s in steps], dtype=float)
    took = np.array([trained[s]["t"] - batches[s]["t"] for s in steps])
    fixed, per_token = float(took.mean()), 0.0
    if len(steps) >= 3 and tokens.std() > 0:
        per_token, fixed = (
            float(v) for v in _nonneg_lstsq(np.stack([tokens, np.ones_like(tokens)], axis=1), took)
        )
    loads: dict[int, float] = {}
    for e in events:
        if e["e"] == "loaded" and e["version"] >= 1:
            loads[e["version"]] = max(loads.get(e["version"], 0.0), e["t"])
    swap = tuple(max(loads[s + 1] - trained[s]["t"], 0.0) for s in steps if s + 1 in loads)
    profile = Profile(
        episodes=tuple(shapes),
        decode_s=float(decode_s),
        decode_s_per_request=float(per_request),
        prefill_s_per_token=float(prefill),
        train_s=fixed,
        train_s_per_token=per_token,
        swap_s=swap or (0.0,),
        checkpoint_s=tuple(e["s"] for e in checkpoints) or (0.0,),
        fit={
            "llm_r2": r2,
            "turns": float(len(turns)),
            "mean_llm_s": float(y.mean()),
            "mean_concurrency": float(b.mean()),
            "steps": float(len(steps)),
        },
    )
    return profile, done
