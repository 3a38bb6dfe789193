"""A sweep from start to end: the runs planned and their configs resolved (every bad key refused before
anything starts), `DIR/sweep.json` written, the shared warm starts run first, then every run not yet
finished, locally or as one SLURM job array (`launch.py sweep`, `rollart_hpc.entry.sweep`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rollart_hpc.sweep.array import ArrayOptions, submit_array
from rollart_hpc.sweep.grid import (
    FINISHED,
    SweepRun,
    expand,
    from_warm_start,
    resolve_runs,
    run_command,
    run_state,
    warm_start_run,
    write_sweep_json,
)
from rollart_hpc.sweep.local import run_local


@dataclass(frozen=True)
class Sweep:
    """What to run: the config with `sets` for every run, the grid (key, values) times the seeds, in
    `out`; locally `parallel` runs at a time, or as a job array (`array`); `shared_warm_start`: the arms
    of a seed start from one warm start (local sweeps)."""

    config: str
    sets: tuple[str, ...]
    grid: tuple[tuple[str, tuple[str, ...]], ...]
    seeds: tuple[int, ...]
    out: Path
    parallel: int = 1
    max_restarts: int = 0
    shared_warm_start: bool = False
    array: ArrayOptions | None = None


def run_sweep(sweep: Sweep) -> int:
    """Run (or continue) `sweep`; 0 when every run finished (or the array was submitted), 1 otherwise."""
    from rollart_hpc.cluster.sbatch import FINISH_MARKERS, check_run_dir

    runs = expand(sweep.grid, sweep.seeds)
    out = sweep.out
    if sweep.array is not None:
        check_run_dir(out)
    warm = [warm_start_run(seed) for seed in sweep.seeds] if sweep.shared_warm_start else []
    runs = [from_warm_start(r, out) for r in runs] if warm else runs
    configs = resolve_runs(sweep.config, sweep.sets, [*warm, *runs], out)
    out.mkdir(parents=True, exist_ok=True)
    write_sweep_json(out, sweep.config, sweep.sets, runs)
    if warm and run_warm_starts(sweep, warm) != 0:
        print("a warm start failed: no arm was started", flush=True)
        return 1
    states = {r.name: run_state(out / r.name, str(FINISH_MARKERS["rl"])) for r in runs}
    print(f"sweep {out}: {len(runs)} runs", flush=True)
    for run in runs:
        print(f"  {run.name:<40} {states[run.name]}", flush=True)
    todo = [r for r in runs if states[r.name] != FINISHED]
    if not todo:
        print("every run has finished", flush=True)
        return 0
    if sweep.array is not None:
        return submit_array(out, todo, configs, states, sweep.array)
    return _run_locally(sweep, todo, states)


def run_warm_starts(sweep: Sweep, warm: Sequence[SweepRun]) -> int:
    """Run (or resume) the warm-start run of every seed that has not finished; 0 when all have."""
    from rollart_hpc.cluster.sbatch import FINISH_MARKERS

    states = {r.name: run_state(sweep.out / r.name, str(FINISH_MARKERS["rl"])) for r in warm}
    todo = [r for r in warm if states[r.name] != FINISHED]
    for run in warm:
        print(f"  {run.name:<40} {states[run.name]} (shared warm start)", flush=True)
    if not todo:
        return 0
    return _run_locally(sweep, todo, states)


def _run_locally(sweep: Sweep, todo: Sequence[SweepRun], states: dict[str, str]) -> int:
    commands = {
        r.name: run_command(sweep.config, sweep.sets, r, sweep.out, states[r.name], sweep.max_restarts)
        for r in todo
    }
    return run_local(sweep.out, [r.name for r in todo], commands, sweep.parallel)
