"""A sweep's runs: the grid of overrides times the seeds, the shared warm start, each run's state in its run
directory, the resolved configs and `DIR/sweep.json` (see `rollart_hpc.entry.sweep` for the command)."""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RUN_OUTPUTS, RunLayout

if TYPE_CHECKING:
    from rollart_hpc.config.schema import Config

SWEEP_JSON = "sweep.json"
SWEEP_LOG = "sweep.log"
SEED_KEY = "run.seed"
WARM_ARM = "warm"
WARM_START_KEYS = ("model.", "envs.", "roles.", "run.", "trainer.sft_")  # grid keys a warm start depends on
FINISHED, RESUME, FRESH = "finished", "resume", "fresh"


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its arm (grid combination), seed and the overrides that make it."""

    arm: str
    seed: int
    grid: tuple[tuple[str, str], ...]  # (key, value) of every grid key, in grid order
    extra: tuple[str, ...] = ()  # overrides of the sweep's own making (the shared warm start)

    @property
    def name(self) -> str:
        return f"{self.arm}/seed={self.seed}"

    @property
    def overrides(self) -> tuple[str, ...]:
        return (*(f"{key}={value}" for key, value in self.grid), f"{SEED_KEY}={self.seed}", *self.extra)


def warm_start_run(seed: int) -> SweepRun:
    """The run whose warm model the arms of `seed` share: the config, one RL step, no evaluation."""
    return SweepRun(WARM_ARM, seed, (), ("controller.num_steps=1", "controller.eval_every_steps=0"))


def warm_model_overrides(warm_run_dir: Path) -> tuple[str, ...]:
    """Overrides that start a run from the warm model of a finished warm-start run (no supervised steps)."""
    warm = RunLayout(warm_run_dir).model / "warm"
    return ('model.source="path"', f"model.path={json.dumps(str(warm))}", "trainer.sft_steps=0")


def from_warm_start(run: SweepRun, out: Path) -> SweepRun:
    """`run`, started from the shared warm model of its seed (no supervised steps of its own)."""
    return replace(run, extra=warm_model_overrides(out / warm_start_run(run.seed).name))


def check_shared_warm_start(grid: Sequence[tuple[str, Sequence[str]]]) -> None:
    for key, _ in grid:
        if key.startswith(WARM_START_KEYS):
            raise UsageError(
                f"--shared-warm-start: --grid {key} changes the warm start; sweep it without sharing"
            )


def split_values(raw: str) -> list[str]:
    """`0.8,0.9` -> ['0.8', '0.9']; commas inside brackets or quotes do not split (`['a','b'],['c']`)."""
    values, depth, quote, current = [], 0, "", ""
    for char in raw:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(current.strip())
            current = ""
            continue
        current += char
    return [*values, current.strip()]


def parse_grid(texts: Sequence[str]) -> list[tuple[str, list[str]]]:
    """`--grid` options -> [(key, values)]; UsageError for a missing `=`, an empty value or a repeated key."""
    grid: list[tuple[str, list[str]]] = []
    for text in texts:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--grid {text!r}: expected KEY=V1,V2,...")
        values = split_values(raw)
        if not all(values):
            raise UsageError(f"--grid {text!r}: empty value in the list {raw!r}")
        if key == SEED_KEY:
            raise UsageError(f"--grid {key}: give seeds with --seeds")
        if key in {k for k, _ in grid}:
            raise UsageError(f"--grid {key} given twice")
        if len(set(values)) != len(values):
            raise UsageError(f"--grid {text!r}: a value is repeated")
        grid.append((key, values))
    return grid


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise UsageError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds {text!r}: a seed is repeated")
    return seeds


def slug(text: str) -> str:
    """A path component: letters, digits and `._=+-` kept, anything else `_`."""
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text)


def expand(grid: Sequence[tuple[str, Sequence[str]]], seeds: Sequence[int]) -> list[SweepRun]:
    """Every grid combination (the first key varies slowest) times every seed."""
    keys = [key for key, _ in grid]
    runs = []
    for values in itertools.product(*(vals for _, vals in grid)):
        pairs = tuple(zip(keys, values, strict=True))
        arm = "__".join(slug(f"{k}={v}") for k, v in pairs) or "base"
        runs += [SweepRun(arm, seed, pairs) for seed in seeds]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise UsageError(
            "two grid values give the same run directory name; make them differ in [A-Za-z0-9._=+-]"
        )
    return runs


def run_state(run_dir: Path, finish_marker: str) -> str:
    """FINISHED (finish marker), RESUME (a resolved config and outputs or a checkpoint), else FRESH."""
    from rollart_hpc.config.resolve import RESOLVED_NAME

    if (run_dir / finish_marker).exists():
        return FINISHED
    started = any((run_dir / name).exists() for name in RUN_OUTPUTS) or any(
        RunLayout(run_dir).checkpoints.glob("step-*")
    )
    return RESUME if (run_dir / RESOLVED_NAME).exists() and started else FRESH


def resolve_runs(
    config_path: str, sets: Sequence[str], runs: Sequence[SweepRun], out: Path
) -> dict[str, Config]:
    """Load every run's config (a bad key or value is a UsageError naming it, before anything starts) and
    check that a run dir made earlier was made with the same config."""
    from rollart_hpc.config import load_config, read_resolved
    from rollart_hpc.config.loader import to_dict
    from rollart_hpc.config.resolve import RESOLVED_NAME

    configs = {}
    for run in runs:
        config = load_config(config_path, [*sets, *run.overrides])
        if config.run.job != "rl":
            raise UsageError(f"sweeps run RL configs; {config_path} has run.job = {config.run.job!r}")
        run_dir = out / run.name
        if (run_dir / RESOLVED_NAME).exists() and to_dict(read_resolved(run_dir)) != to_dict(config):
            raise UsageError(
                f"{run_dir} was made with another config than this sweep's; use a new --out or remove it"
            )
        configs[run.name] = config
    return configs


def write_sweep_json(out: Path, config_path: str, sets: Sequence[str], runs: Sequence[SweepRun]) -> None:
    """DIR/sweep.json: the sweep's config, --set overrides and every run (runs of an earlier invocation
    with other grid values or seeds are kept). Another config or --set in the same DIR is refused."""
    from rollart_hpc.contracts.atomic import atomic_write_json

    path = out / SWEEP_JSON
    old = json.loads(path.read_text()) if path.exists() else {}
    head = {"config": str(Path(config_path).resolve()), "set": list(sets)}
    if old and {k: old.get(k) for k in head} != head:
        raise UsageError(f"{path} is a sweep of another config or --set; use a new --out")
    rows = {row["name"]: row for row in old.get("runs", [])}
    for run in runs:
        rows[run.name] = {
            "name": run.name,
            "arm": run.arm,
            "seed": run.seed,
            "grid": dict(run.grid),
            "overrides": list(run.overrides),
            "run_dir": run.name,
        }
    atomic_write_json(path, {**old, **head, "runs": list(rows.values())})


def read_sweep_runs(out: Path) -> list[dict[str, Any]]:
    """The runs listed in DIR/sweep.json (`name`, `arm`, `seed`, `grid`, `overrides`, `run_dir`)."""
    return list(json.loads((out / SWEEP_JSON).read_text())["runs"])


def run_command(
    config_path: str, sets: Sequence[str], run: SweepRun, out: Path, state: str, max_restarts: int
) -> list[str]:
    """The `launch.py run` (fresh) or `launch.py resume` command of a run."""
    cli = [sys.executable, "-m", "rollart_hpc.entry.cli"]
    restart = ["--max-restarts", str(max_restarts)]
    if state == RESUME:
        return [*cli, "resume", str(out / run.name), *restart]
    return [*cli, "run", config_path, *sets, *run.overrides, "--run-dir", str(out / run.name), *restart]
