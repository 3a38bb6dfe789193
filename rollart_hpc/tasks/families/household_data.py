"""The on-disk cache of household games: where it lives, how it is prepared, how it is read.

Layout: `<data dir>/household/v1/game_XXX.{z8,json,meta.json}`, then `manifest.json` and last the
`READY` marker. The held-out games (ids 128.., seeds no training game uses; evaluation only) have the
same layout under `<data dir>/household/v1-heldout/`, with a manifest and marker of their own. The data dir is `$ROLLART_DATA`, default `<repo root>/data`. Readers trust a cache only
when `READY` exists (it is written after the manifest, which is written after every game has been
generated and its walkthrough replayed to a win), so an interrupted `prepare` is redone, never used.

`prepare` runs the generator in `num_procs` child processes (ids split evenly) under
`PYTHONHASHSEED=0` and a private `TMPDIR` each; it tracks their pids, kills them if one fails or the
caller is interrupted, and waits for all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollart_hpc.config.schema import HELDOUT_MAX
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.tasks.families.household_gen import NUM_GAMES

CACHE_VERSION = "v1"
READY = "READY"
NUM_HELDOUT = HELDOUT_MAX["household"]  # held-out games: ids NUM_GAMES .. NUM_GAMES + NUM_HELDOUT - 1


def data_dir() -> Path:
    """`$ROLLART_DATA` if set, else `<repo root>/data`."""
    env = os.environ.get("ROLLART_DATA")
    return Path(env).resolve() if env else Path(__file__).resolve().parents[3] / "data"


def household_dir(root: Path | None = None, heldout: bool = False) -> Path:
    """The training games' folder, or with `heldout` the held-out games' folder."""
    return (root or data_dir()) / "household" / (f"{CACHE_VERSION}-heldout" if heldout else CACHE_VERSION)


def is_heldout(index: int) -> bool:
    return index >= NUM_GAMES


def is_ready(root: Path | None = None, heldout: bool = False) -> bool:
    return (household_dir(root, heldout) / READY).exists()


def load_manifest(root: Path | None = None, heldout: bool = False) -> list[dict[str, Any]]:
    """The manifest records (index, type, seed, objective, walkthrough, sha256), by index."""
    folder = household_dir(root, heldout)
    if not (folder / READY).exists():
        raise FileNotFoundError(f"household games are not prepared in {folder}: run `launch.py envs prepare`")
    path = folder / "manifest.json"
    try:
        games = json.loads(path.read_text())["games"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path}: malformed household task file ({type(exc).__name__}: {exc})") from None
    if not isinstance(games, list):
        raise UsageError(f"{path}: malformed household task file ('games' is not a list)")
    for position, game in enumerate(games):
        _check_game(path, position, game)
    return list(games)


# Manifest record field -> the type it must have.
GAME_FIELDS: dict[str, type] = {
    "index": int,
    "type": str,
    "objective": str,
    "walkthrough": list,
    "sha256": str,
}


def _check_game(path: Path, position: int, game: object) -> None:
    if not isinstance(game, dict):
        raise UsageError(f"{path}: malformed household task file (games[{position}] is not an object)")
    for name, kind in GAME_FIELDS.items():
        value = game.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UsageError(
                f"{path}: malformed household task file (games[{position}].{name} missing or not {kind.__name__})"
            )
    if not all(isinstance(cmd, str) for cmd in game["walkthrough"]):
        raise UsageError(
            f"{path}: malformed household task file (games[{position}].walkthrough holds non-text)"
        )


def game_path(index: int, root: Path | None = None) -> Path:
    return household_dir(root, is_heldout(index)) / f"game_{index:03d}.z8"


def prepare(root: Path | None = None, num_procs: int = 2, force: bool = False, log: Any = print) -> Path:
    """Generate, verify and index the training games, then the held-out games, each unless a READY cache
    of it exists; returns the training cache folder."""
    folder = _prepare_split(household_dir(root), range(NUM_GAMES), num_procs, force, log)
    _prepare_split(
        household_dir(root, True), range(NUM_GAMES, NUM_GAMES + NUM_HELDOUT), num_procs, force, log
    )
    return folder


def _prepare_split(folder: Path, ids: range, num_procs: int, force: bool, log: Any) -> Path:
    if (folder / READY).exists() and not force:
        log(f"household games already prepared in {folder}")
        return folder
    (folder / READY).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _run_generators(folder, ids, num_procs)
    log(f"generated {len(ids)} games in {time.monotonic() - started:.0f} s; replaying walkthroughs")
    games = [_verify(folder, i) for i in ids]
    _write_atomic(folder / "manifest.json", json.dumps({"version": CACHE_VERSION, "games": games}, indent=1))
    _write_atomic(folder / READY, f"{len(games)}\n")
    log(f"household cache ready: {folder} ({len(games)} games, {time.monotonic() - started:.0f} s)")
    return folder


def _run_generators(folder: Path, ids: range, num_procs: int) -> None:
    bounds = [ids.start + round(k * len(ids) / num_procs) for k in range(num_procs + 1)]
    tmp_root = Path(tempfile.mkdtemp(prefix="rollart_household_"))
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for k in range(num_procs):
            procs[k] = _spawn(folder, bounds[k], bounds[k + 1], tmp_root / str(k))
        for k, proc in procs.items():
            if proc.wait() != 0:
                raise RuntimeError(f"household generator {k} (pid {proc.pid}) exited with {proc.returncode}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp_root, ignore_errors=True)


def _spawn(folder: Path, first: int, last: int, tmp: Path) -> subprocess.Popen[bytes]:
    tmp.mkdir(parents=True)
    env = dict(os.environ, PYTHONHASHSEED="0", TMPDIR=str(tmp))
    cmd = [
        sys.executable,
        "-m",
        "rollart_hpc.tasks.families.household_gen",
        str(folder),
        str(first),
        str(last),
    ]
    return subprocess.Popen(cmd, env=env, cwd=str(Path(__file__).resolve().parents[3]))


def _verify(folder: Path, index: int) -> dict[str, Any]:
    """Replay game `index`'s walkthrough through TextWorld; return its manifest record."""
    import textworld

    meta = json.loads((folder / f"game_{index:03d}.meta.json").read_text())
    path = folder / f"game_{index:03d}.z8"
    env = textworld.start(str(path), request_infos=textworld.EnvInfos(won=True))
    try:
        env.reset()
        won = False
        for cmd in meta["walkthrough"]:
            state, _, done = env.step(cmd)
            won = bool(state["won"])
            if done:
                break
    finally:
        env.close()
    if not won:
        raise RuntimeError(f"household game {index}: walkthrough does not win")
    (folder / f"game_{index:03d}.ni").unlink(missing_ok=True)
    meta["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(meta)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
