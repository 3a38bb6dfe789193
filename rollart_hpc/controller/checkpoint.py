"""Run checkpoints: `run_dir/checkpoints/step-NNNNNN/` with the trainer's distributed checkpoint in
`trainer/`, the controller's state in `controller.pkl`, and `COMPLETE` written last.

Readers trust a checkpoint only when `COMPLETE` exists (an interrupted save is ignored and later removed).
The controller's state holds the `ControllerCore` state (versions, counters, tickets in flight, buffered
trajectories, tracker, sampler RNG), the HDF5 store position and the per-rollout version history; a
resumed run truncates the store and `metrics.jsonl` back to that point, so nothing is counted twice.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

from rollart_hpc.contracts.atomic import atomic_write_bytes, atomic_write_json

COMPLETE = "COMPLETE"
CONTROLLER_STATE = "controller.pkl"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_dir(run_dir: Path, version: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{version:06d}"


def complete(path: Path) -> bool:
    return (path / COMPLETE).exists()


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = sorted(p for p in checkpoints_dir(run_dir).glob("step-*") if complete(p))
    return found[-1] if found else None


def write_controller_state(path: Path, state: dict[str, Any]) -> None:
    """Controller part of a checkpoint; marks the checkpoint complete (the trainer part is already there)."""
    atomic_write_bytes(path / CONTROLLER_STATE, pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    atomic_write_json(path / COMPLETE, {"version": state["core"]["version"]})


def read_controller_state(path: Path) -> dict[str, Any]:
    if not complete(path):
        raise ValueError(f"checkpoint {path} is incomplete (no {COMPLETE} marker)")
    with (path / CONTROLLER_STATE).open("rb") as fh:
        state: dict[str, Any] = pickle.load(fh)
    return state


def discard_incomplete(run_dir: Path) -> list[Path]:
    """Remove checkpoint directories without COMPLETE (a save cut short by a crash). Call only when no
    save can be running: at the start of a run, before the controller writes any checkpoint."""
    removed = [p for p in checkpoints_dir(run_dir).glob("step-*") if not complete(p)]
    for path in removed:
        shutil.rmtree(path)
    return removed


def prune(run_dir: Path, keep: int) -> list[Path]:
    """Remove incomplete checkpoints and all but the newest `keep` complete ones."""
    removed = []
    entries = sorted(checkpoints_dir(run_dir).glob("step-*"))
    complete_ones = [p for p in entries if complete(p)]
    newest = latest(run_dir)
    for path in entries:
        stale_partial = not complete(path) and newest is not None and path < newest
        if stale_partial or (complete(path) and path not in complete_ones[-keep:]):
            shutil.rmtree(path)
            removed.append(path)
    return removed
