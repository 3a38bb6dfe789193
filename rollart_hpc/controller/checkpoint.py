"""Run checkpoints: `run_dir/checkpoints/step-NNNNNN/` with the trainer's distributed checkpoint in
`trainer/`, the controller's state in `controller.pkl`, and `COMPLETE` written last.

Readers trust a checkpoint only when `COMPLETE` exists (an interrupted save is ignored and later removed).
`COMPLETE` also lists every file of the checkpoint with its size; `latest_valid` discards (with a log line)
a complete checkpoint whose files are missing, truncated or unreadable and falls back to the next older one,
so a damaged newest checkpoint costs the steps since the older one instead of every later restart.
The controller's state holds the `ControllerCore` state (versions, counters, tickets in flight, buffered
trajectories, tracker, sampler RNG), the HDF5 store position and the per-rollout version history; a
resumed run truncates the store and `metrics.jsonl` back to that point, so nothing is counted twice.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.atomic import atomic_write_bytes, atomic_write_json
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout

COMPLETE = "COMPLETE"
CONTROLLER_STATE = "controller.pkl"


def checkpoints_dir(run_dir: Path) -> Path:
    return RunLayout(run_dir).checkpoints


def step_dir(run_dir: Path, version: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{version:06d}"


def complete(path: Path) -> bool:
    return (path / COMPLETE).exists()


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = sorted(p for p in checkpoints_dir(run_dir).glob("step-*") if complete(p))
    return found[-1] if found else None


# Config fields a checkpoint depends on: its weights' shapes, its task ids, its tracker and sampler state,
# the meaning of its step and version counts. A checkpoint is only resumed under the same values.
FINGERPRINT_SECTIONS = (
    "run.seed",
    "model",
    "envs.families",
    "envs.num_tasks",
    "envs.calc_max_ops",
    "envs.household_types",
    "envs.household_numbered",
    "algo",
    "controller.mode",
    "controller.batch_size",
    "controller.max_staleness",
)


def config_fingerprint(config: Config) -> dict[str, Any]:
    """Dotted field -> value for every field under FINGERPRINT_SECTIONS (JSON-ready)."""
    flat: dict[str, Any] = {}
    for dotted in FINGERPRINT_SECTIONS:
        value: Any = config
        for part in dotted.split("."):
            value = getattr(value, part)
        is_section = dataclasses.is_dataclass(value) and not isinstance(value, type)
        _flatten(dotted, dataclasses.asdict(value) if is_section else value, flat)
    return json.loads(json.dumps(flat))


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and not prefix.endswith("num_tasks"):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}", inner, out)
    else:
        out[prefix] = value


def _added_at_default(config: Config, dotted: str) -> bool:
    """True when field `dotted` (absent from a checkpoint's fingerprint: the schema gained it after the
    checkpoint was written) holds its schema default in `config`, so the run behaves as the one that
    wrote the checkpoint did (a new field's default keeps the old behaviour)."""
    *parents, name = dotted.split(".")
    section: Any = config
    for part in parents:
        section = getattr(section, part, None)
    if not (dataclasses.is_dataclass(section) and not isinstance(section, type)):
        return False
    field = {f.name: f for f in dataclasses.fields(section)}.get(name)
    if field is None:
        return False
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        return False
    return bool(getattr(section, name) == default)


def check_fingerprint(path: Path, config: Config) -> None:
    """UsageError (one line) when the checkpoint was written under other values of the fields that matter."""
    marker = json.loads((path / COMPLETE).read_text())
    saved = marker.get("config")
    if saved is None:
        return  # written before checkpoints carried a fingerprint
    current = config_fingerprint(config)
    differ = sorted(
        k
        for k in saved.keys() | current.keys()
        if saved.get(k) != current.get(k) and not (k not in saved and _added_at_default(config, k))
    )
    if differ:
        key = differ[0]
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise UsageError(
            f"checkpoint {path} is from another config: {key} was {saved.get(key)!r}, "
            f"the run's config says {current.get(key)!r}{more}"
        )


def write_controller_state(path: Path, state: dict[str, Any], config: Config) -> None:
    """Controller part of a checkpoint; marks the checkpoint complete (the trainer part is already there).
    The marker carries the config fingerprint that `check_fingerprint` compares on resume."""
    atomic_write_bytes(path / CONTROLLER_STATE, pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
    marker = {
        "version": state["core"]["version"],
        "config": config_fingerprint(config),
        "files": manifest(path),
    }
    atomic_write_json(path / COMPLETE, marker)


def manifest(path: Path) -> dict[str, int]:
    """Relative path -> size of every file under a checkpoint directory except its own COMPLETE marker."""
    files = (p for p in sorted(path.rglob("*")) if p.is_file() and p != path / COMPLETE)
    return {str(p.relative_to(path)): p.stat().st_size for p in files}


def trainer_bytes_per_rank(path: Path) -> dict[str, int]:
    """Trainer rank -> bytes of its shard files (`trainer/__<rank>_<k>.distcp`) in a checkpoint."""
    out: dict[str, int] = {}
    for file in sorted((path / "trainer").glob("__*_*.distcp")):
        rank = file.name[2:].split("_", 1)[0]
        out[rank] = out.get(rank, 0) + file.stat().st_size
    return out


def problem(path: Path) -> str | None:
    """Why a complete checkpoint cannot be resumed from (a file missing, truncated or unreadable), or None.
    Checkpoints written before markers listed their files are checked for their controller state only."""
    try:
        listed: dict[str, int] = json.loads((path / COMPLETE).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError) as exc:
        return f"unreadable {COMPLETE} marker ({exc})"
    for name, size in listed.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the checkpoint wrote {size}"
    try:
        read_controller_state(path)
    except UsageError as exc:
        return str(exc)
    return None


def latest_valid(run_dir: Path, log: Callable[[str], None]) -> Path | None:
    """The newest complete checkpoint whose files pass `problem`; newer damaged ones are removed, each
    with a log line. Call only when no save can be running (before a world starts, or at its start)."""
    for path in sorted((p for p in checkpoints_dir(run_dir).glob("step-*") if complete(p)), reverse=True):
        found = problem(path)
        if found is None:
            return path
        log(f"discarding damaged checkpoint {path}: {found}")
        shutil.rmtree(path)
    return None


def read_controller_state(path: Path) -> dict[str, Any]:
    if not complete(path):
        raise ValueError(f"checkpoint {path} is incomplete (no {COMPLETE} marker)")
    try:
        with (path / CONTROLLER_STATE).open("rb") as fh:
            state: dict[str, Any] = pickle.load(fh)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as exc:
        raise UsageError(f"{path / CONTROLLER_STATE}: unreadable controller state ({exc})") from None
    return state


def check_resumable(run_dir: Path, config: Config, path: Path) -> None:
    """Before a resume changes anything: the checkpoint at `path` belongs to this config, its controller
    state reads, and the trajectory store holds everything the checkpoint counts. UsageError otherwise."""
    from rollart_hpc.store.trajectories import StorePosition  # h5py
    from rollart_hpc.store.trajectories import check_resumable as check_store

    check_fingerprint(path, config)
    state = read_controller_state(path)
    check_store(RunLayout(run_dir).trajectories, StorePosition(**state["store"]))


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
