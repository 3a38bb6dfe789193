"""`launch.py bench e2e --json OUT [--steps N] [--batch B] [--seeds 0,1,2] [--metric eval|train]
[--shared-warm-start] [k=v ...]`.

The same multi-task workload with long-tailed env latency, run per mode (sync, one_step_off, async with
max_staleness 1) and per seed with the same config, model, steps and batch size, so every mode trains the
same number of trajectories. Each run is `launch.py run` in a subprocess (one after the other, never in
parallel), with its run directory `<mode>/seed=<s>` and log under --out-dir. Extra dotted overrides apply
to every run.

`--shared-warm-start`: per seed, one warm-start run `warm/seed=<s>` (the config, one RL step, no evaluation,
as `launch.py sweep --shared-warm-start` makes it) runs first, and every mode's run of that seed starts from
its warm model with no supervised steps of its own. The modes are then compared from the same initial policy,
and the warm start is not paid once per mode.

The success series of a run (`--metric`): `eval`, the evaluation rounds' `eval_success` (uniform over the
training tasks, so the sampler's task mix cannot move it; needs `controller.eval_every_steps > 0`), or
`train`, the trailing mean of `train_success` over `--window` steps. Times are the rows' wall_s (seconds
since RL start, after the warm start).

Target, per seed: `--target-success X` when given (the same for every seed); otherwise the sync run of that
seed's start plus `--target-fraction` f (default 0.8) of its gain, `start + f * (final - start)`, with start
and final its series' first and last value. Every mode's run of a seed is timed to that seed's target, so a
seed whose warm start is already good is not counted as reaching a target at once, nor a weak one as never
reaching it (seeds' warm starts differ by tens of points). A run reaches its target at its first point >=
the target. Without a sync gain for a seed (final <= start) its target is undefined and its times are null,
the reason in `target.note`.

Per mode the JSON holds per seed and as means over seeds: RL wall-clock, throughput (trained trajectories/s,
tokens/s), time to target (the mean only when every seed reached it), the busy fraction of each role
(timeline files), and ratios to sync: `speedup_time_to_target` (mean sync time / mean mode time over the
seeds where both reached their target; their number in `speedup_time_to_target_seeds`; null when none),
`speedup_throughput` and `speedup_wall`.

A rerun with the same --out-dir reuses every run that finished with the same `launch.py run` arguments
(recorded in the run directory's `bench_e2e_command.json`) and runs the rest; a finished run made with other
arguments, or a run directory left by an interrupted run, is an error.

PNGs beside the JSON: `<stem>-reward.png` (the success series vs wall-clock, every seed, one colour per
mode) and `<stem>-utilisation.png` (per mode, its first seed's per-role busy fraction over time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollart_hpc.config.choices import MODES
from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.sweep.grid import WARM_ARM, warm_model_overrides, warm_start_run

REPO = Path(__file__).resolve().parents[2]
UTILISATION_BINS = 60
COMMAND_FILE = "bench_e2e_command.json"  # in a run directory: the `launch.py run` arguments that made it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", required=True, type=Path, help="write the results here (JSON)")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "local.toml", help="run config")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=16, help="trajectories per step")
    parser.add_argument("--modes", default=",".join(MODES), help="modes to run (sync must be among them)")
    parser.add_argument("--latency", choices=["none", "lognormal", "pareto"], default="pareto")
    parser.add_argument("--latency-scale-s", type=float, default=0.2, help="latency scale per env step, s")
    parser.add_argument("--latency-max-s", type=float, default=5.0, help="cap on one step's latency, s")
    parser.add_argument("--seeds", default="0", help="comma-separated run.seed values (default 0)")
    parser.add_argument(
        "--metric", choices=["eval", "train"], default="eval", help="success series: eval rounds or train"
    )
    parser.add_argument("--target-success", type=float, default=None, help="fixed target success")
    parser.add_argument("--target-fraction", type=float, default=0.8, help="of the sync runs' gain")
    parser.add_argument("--window", type=int, default=3, help="--metric train: steps in the trailing mean")
    parser.add_argument("--out-dir", type=Path, default=None, help="run dirs (default: beside --json)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit per run, seconds")
    parser.add_argument(
        "--shared-warm-start", action="store_true", help="the modes of a seed start from one warm start"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run (key=value)")


# ---- running ----------------------------------------------------------------------------------------
def mode_overrides(args: argparse.Namespace, mode: str) -> list[str]:
    out = [
        f"controller.mode={json.dumps(mode)}",
        f"controller.num_steps={args.steps}",
        f"controller.batch_size={args.batch}",
        "controller.checkpoint_every_steps=0",
        f"envs.faults.latency={json.dumps(args.latency)}",
    ]
    if args.latency != "none":
        out += [
            f"envs.faults.latency_scale_s={args.latency_scale_s}",
            f"envs.faults.latency_max_s={args.latency_max_s}",
        ]
    if mode == "async":
        out.append("controller.max_staleness=1")
    return out


def run_mode(
    args: argparse.Namespace, mode: str, seed: int, out_dir: Path, extra: Sequence[str] = ()
) -> Path:
    """`launch.py run` for one mode and seed (mode "warm": the shared warm start); returns its run
    directory. A failed run raises with its log's tail."""
    run_dir = (out_dir / mode / f"seed={seed}").resolve()
    cmd = [
        sys.executable,
        "-m",
        "rollart_hpc.entry.cli",
        "run",
        str(args.config.resolve()),
        "--run-dir",
        str(run_dir),
    ]
    if mode == WARM_ARM:
        cmd += [*args.overrides, *warm_start_run(seed).overrides]
    else:
        cmd += [*args.overrides, *mode_overrides(args, mode), f"run.seed={seed}", *extra]
    made_by = run_dir / COMMAND_FILE
    if RunLayout(run_dir).summary.exists():
        if not made_by.exists() or json.loads(made_by.read_text(encoding="utf-8")) != cmd[3:]:
            raise UsageError(
                f"{run_dir} was run with other settings than this command's: choose another --out-dir"
            )
        print(f"[{mode} seed {seed}] finished before with the same command: reused ({run_dir})", flush=True)
        return run_dir
    if run_dir.exists():
        raise UsageError(f"{run_dir} holds an unfinished run: remove it, or choose an empty --out-dir")
    log = out_dir / f"{mode}-seed={seed}.log"
    print(f"[{mode} seed {seed}] {' '.join(cmd[3:])}", flush=True)
    with log.open("w", encoding="utf-8") as fh:
        rc = subprocess.run(
            cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout_s
        ).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(encoding="utf-8").splitlines()[-15:])
        raise RuntimeError(f"bench e2e: the {mode} run failed (exit {rc}); log {log}:\n{tail}")
    atomic_write_json(made_by, cmd[3:])
    return run_dir


# ---- analysis ---------------------------------------------------------------------------------------
def trailing_means(values: list[float], window: int) -> list[float]:
    """Mean of each value and the up to window - 1 values before it."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i + 1 - window) : i + 1]
        out.append(sum(part) / len(part))
    return out


Series = list[tuple[float, float]]  # (wall_s since RL start, success)


def success_series(
    rows: list[dict[str, Any]], evals: list[dict[str, Any]], metric: str, window: int
) -> Series:
    """A run's success over wall-clock: its evaluation rounds, or the trailing train-success mean."""
    if metric == "eval":
        return [(float(r["wall_s"]), float(r["eval_success"])) for r in evals if "eval_success" in r]
    means = trailing_means([float(r["train_success"]) for r in rows], window)
    return [(float(r["wall_s"]), m) for r, m in zip(rows, means, strict=True)]


def pick_target(args: argparse.Namespace, sync_series: list[Series]) -> dict[str, Any]:
    """The target success of each seed (see the module docstring), from the sync runs' series in the
    order of --seeds: `values[i]` is the i-th seed's target, None where it is undefined."""
    seed_values = seeds(args)
    base = {"metric": args.metric, "window": args.window}
    if args.target_success is not None:
        value = float(args.target_success)
        values: list[float | None] = [value] * len(sync_series)
        return {**base, "values": values, "how": "fixed (--target-success)", "defined": True, "note": ""}
    values, notes = [], []
    for index, series in enumerate(sync_series):
        if not series:
            values.append(None)
            notes.append(f"the sync run of seed {seed_values[index]} has no {args.metric} success rows")
            continue
        start, final = series[0][1], series[-1][1]
        if final <= start:
            values.append(None)
            notes.append(
                f"the sync run of seed {seed_values[index]} gained no success ({start:.4f} -> {final:.4f})"
            )
            continue
        values.append(start + args.target_fraction * (final - start))
    how = f"per seed: the sync run's start + {args.target_fraction} x its gain (final - start)"
    note = "; ".join(notes) + ("; those seeds' times are undefined" if notes else "")
    defined = any(v is not None for v in values)
    return {**base, "values": values, "how": how, "defined": defined, "note": note}


def time_to_target(series: Series, target: dict[str, Any], index: int) -> float | None:
    """When `series` (a run of the seed at `index`) first reaches that seed's target; None if never."""
    value = target["values"][index]
    if value is None:
        return None
    return next((wall for wall, success in series if success >= value), None)


def seed_result(
    run_dir: Path, args: argparse.Namespace, target: dict[str, Any], index: int
) -> dict[str, Any]:
    from rollart_hpc.metrics.report import busy_fractions, load_run, overall_throughput, write_report
    from rollart_hpc.metrics.timeline import role_busy_fractions, window

    run = load_run(run_dir)
    span = window(run.timelines)
    write_report(run_dir)
    t = overall_throughput(run.rows)
    series = success_series(run.rows, run.eval_rows, args.metric, args.window)
    return {
        "run_dir": str(run_dir),
        "steps": len(run.rows),
        "trained_trajectories": sum(int(r["trained_trajectories"]) for r in run.rows),
        "tokens": sum(int(r.get("tokens", 0)) for r in run.rows),
        "wall_s": t["wall_s"],
        "trajectories_per_s": t["trajectories_per_s"],
        "tokens_per_s": t["tokens_per_s"],
        "final_success": series[-1][1] if series else None,
        "series": series,
        "target_success": target["values"][index],
        "time_to_target_s": time_to_target(series, target, index),
        "busy_fraction_by_role": role_busy_fractions(run.timelines, *span) if span else {},
        "busy_fraction_by_rank": busy_fractions(run),
        "staleness": (run.summary or {}).get("staleness", {}),
        "balanced": (run.summary or {}).get("balanced"),
    }


def mode_result(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over a mode's seeds (time to target only when every seed reached it), and every seed."""

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in seeds) / len(seeds)

    times = [r["time_to_target_s"] for r in seeds]
    finals = [r["final_success"] for r in seeds]
    return {
        "seeds": seeds,
        "steps": seeds[0]["steps"],
        "trained_trajectories": seeds[0]["trained_trajectories"],
        "wall_s": mean("wall_s"),
        "trajectories_per_s": mean("trajectories_per_s"),
        "tokens_per_s": mean("tokens_per_s"),
        "final_success": None if None in finals else sum(finals) / len(finals),
        "time_to_target_s": None if None in times else sum(times) / len(times),
        "time_to_target_per_seed_s": times,
        "busy_fraction_by_role": {
            role: sum(r["busy_fraction_by_role"].get(role, 0.0) for r in seeds) / len(seeds)
            for role in seeds[0]["busy_fraction_by_role"]
        },
        "balanced": all(r["balanced"] for r in seeds),
    }


def add_speedups(results: dict[str, dict[str, Any]]) -> None:
    sync = results["sync"]
    for r in results.values():
        pairs = [
            (s, m)
            for s, m in zip(sync["time_to_target_per_seed_s"], r["time_to_target_per_seed_s"], strict=True)
            if s is not None and m is not None
        ]
        both = sum(m for _, m in pairs)
        r["speedup_time_to_target"] = sum(s for s, _ in pairs) / both if pairs and both > 0 else None
        r["speedup_time_to_target_seeds"] = len(pairs)
        r["speedup_throughput"] = r["trajectories_per_s"] / sync["trajectories_per_s"]
        r["speedup_wall"] = sync["wall_s"] / r["wall_s"]


# ---- plots ------------------------------------------------------------------------------------------
def plot_reward(results: dict[str, dict[str, Any]], target: dict[str, Any], path: Path) -> Path:
    from rollart_hpc.metrics.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index, (mode, result) in enumerate(results.items()):
        for k, seed in enumerate(result["seeds"]):
            walls = [wall for wall, _ in seed["series"]]
            values = [value for _, value in seed["series"]]
            ax.plot(walls, values, marker=".", color=f"C{index}", label=mode if k == 0 else None, alpha=0.8)
    labelled = False
    for value in target["values"]:
        if value is not None:
            label = None if labelled else "target per seed"
            ax.axhline(value, color="grey", linestyle="--", linewidth=0.8, label=label)
            labelled = True
    what = (
        "eval success"
        if target["metric"] == "eval"
        else f"train success (trailing mean of {target['window']})"
    )
    ax.set(xlabel="wall-clock since RL start (s)", ylabel=what)
    ax.set_title(f"{what} vs wall-clock, every seed")
    ax.legend()
    return save_figure(fig, path)


def plot_utilisation(run_dirs: dict[str, Path], path: Path) -> Path:
    from rollart_hpc.metrics.report import pyplot, save_figure
    from rollart_hpc.metrics.timeline import read_timelines, utilisation, window

    plt = pyplot()
    fig, axes = plt.subplots(len(run_dirs), 1, figsize=(10, 2.6 * len(run_dirs)), sharex=True, squeeze=False)
    for ax, (mode, run_dir) in zip(axes[:, 0], run_dirs.items(), strict=True):
        timelines = read_timelines(run_dir)
        span = window(timelines)
        if span is None:
            ax.set_title(f"{mode}: no timeline files")
            continue
        width = (span[1] - span[0]) / UTILISATION_BINS
        xs = [(i + 0.5) * width for i in range(UTILISATION_BINS)]
        for role in sorted({t.role for t in timelines}):
            ranks = [utilisation(t.intervals, *span, UTILISATION_BINS) for t in timelines if t.role == role]
            ax.plot(xs, [sum(col) / len(col) for col in zip(*ranks, strict=True)], label=role)
        ax.set(ylabel="busy fraction", ylim=(0, 1.05), title=mode)
        ax.legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("seconds since the run's first recorded interval")
    return save_figure(fig, path)


# ---- entry ------------------------------------------------------------------------------------------
def check_args(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "sync" not in modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise UsageError(
            f"--modes: distinct names from {', '.join(MODES)}, sync included; got {args.modes!r}"
        )
    if args.steps < 1 or args.batch < 1 or args.window < 1:
        raise UsageError("--steps, --batch and --window must be >= 1")
    seeds(args)
    if not 0 < args.target_fraction <= 1:
        raise UsageError(f"--target-fraction must lie in (0, 1], got {args.target_fraction}")
    if not args.config.is_file():
        raise UsageError(f"--config: {args.config} is not a file")
    stray = [o for o in args.overrides if "=" not in o]
    if stray:
        raise UsageError(f"overrides must be key=value, got {' '.join(stray)}")
    return ["sync", *[m for m in MODES if m in modes and m != "sync"]]


def seeds(args: argparse.Namespace) -> list[int]:
    try:
        values = [int(v) for v in args.seeds.split(",")]
    except ValueError:
        raise UsageError(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if len(set(values)) != len(values):
        raise UsageError(f"--seeds {args.seeds!r}: a seed is repeated")
    return values


def check_metric(args: argparse.Namespace) -> None:
    """--metric eval needs evaluation rounds in the runs' config."""
    if args.metric != "eval":
        return
    from rollart_hpc.config import load_config

    config = load_config(str(args.config), list(args.overrides))
    if config.controller.eval_every_steps <= 0:
        raise UsageError(
            "--metric eval needs evaluation rounds: controller.eval_every_steps > 0 "
            "(in the config or as an override), or --metric train"
        )


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    modes = check_args(args)
    check_metric(args)
    out_dir = args.out_dir or args.json.with_name(args.json.stem + "-runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    extra: dict[int, tuple[str, ...]] = {seed: () for seed in seeds(args)}
    if args.shared_warm_start:
        extra = {seed: warm_model_overrides(run_mode(args, WARM_ARM, seed, out_dir)) for seed in seeds(args)}
    run_dirs = {
        mode: [run_mode(args, mode, seed, out_dir, extra[seed]) for seed in seeds(args)] for mode in modes
    }
    from rollart_hpc.metrics.report import load_run

    sync_series = []
    for run_dir in run_dirs["sync"]:
        run = load_run(run_dir)
        sync_series.append(success_series(run.rows, run.eval_rows, args.metric, args.window))
    target = pick_target(args, sync_series)
    results = {
        mode: mode_result([seed_result(d, args, target, i) for i, d in enumerate(dirs)])
        for mode, dirs in run_dirs.items()
    }
    add_speedups(results)
    first = {mode: dirs[0] for mode, dirs in run_dirs.items()}
    plots = {
        "reward": str(plot_reward(results, target, args.json.with_name(args.json.stem + "-reward.png"))),
        "utilisation": str(plot_utilisation(first, args.json.with_name(args.json.stem + "-utilisation.png"))),
    }
    workload = {
        "config": str(args.config),
        "steps": args.steps,
        "batch": args.batch,
        "seeds": seeds(args),
        "metric": args.metric,
        "latency": {"dist": args.latency, "scale_s": args.latency_scale_s, "max_s": args.latency_max_s},
        "overrides": list(args.overrides),
        "shared_warm_start": bool(args.shared_warm_start),
    }
    return {"workload": workload, "target": target, "modes": results, "plots": plots}


def main(args: argparse.Namespace) -> int:
    result = run_bench(args)
    atomic_write_json(args.json, result)
    for mode, r in result["modes"].items():
        ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}s"
        print(
            f"{mode:>13}: wall {r['wall_s']:.1f}s, {r['trajectories_per_s']:.2f} traj/s, "
            f"{r['tokens_per_s']:.0f} tok/s, to target {ttt}, speedup wall {r['speedup_wall']:.2f}x"
        )
    print(f"wrote {args.json}")
    return 0
