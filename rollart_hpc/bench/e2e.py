"""`launch.py bench e2e --json OUT [--steps N] [--batch B] [--latency pareto ...] [--out-dir D] [k=v ...]`.

The same multi-task workload with long-tailed env latency, run once per mode (sync, one_step_off, async
with max_staleness 1) with the same config, model, seeds, steps and batch size, so every mode trains the
same number of trajectories. Each run is `launch.py run` in a subprocess (one after the other, never in
parallel), with its run directory and log under --out-dir. Extra dotted overrides apply to every run.

Per mode the JSON holds: RL wall-clock, throughput (trained trajectories/s, tokens/s), time to the target
training success, the busy fraction of each role (from the ranks' timeline files), and ratios to sync:
`speedup_time_to_target` (sync time / mode time), `speedup_throughput` (mode rate / sync rate) and
`speedup_wall` (sync RL wall-clock / mode RL wall-clock, the end-to-end training-time ratio).

Target: `--target-success X` when given; otherwise `--target-fraction` (default 0.8) of the sync run's
final success, the mean `train_success` of its last `--window` steps. A mode reaches the target at the
first step whose trailing mean over `--window` steps is >= the target; its time is that step's wall_s
(seconds since RL start, after warm start). A target <= 0 is undefined (no learning signal): times and
their speedups are null then, with the reason in `target.note`.

PNGs beside the JSON: `<stem>-reward.png` (success vs wall-clock, per mode) and `<stem>-utilisation.png`
(per mode, per role busy fraction over time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from rollart_hpc.config.choices import MODES
from rollart_hpc.contracts.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
UTILISATION_BINS = 60


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", required=True, type=Path, help="write the results here (JSON)")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "local.toml", help="run config")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=16, help="trajectories per step")
    parser.add_argument("--modes", default=",".join(MODES), help="modes to run (sync must be among them)")
    parser.add_argument("--latency", choices=["none", "lognormal", "pareto"], default="pareto")
    parser.add_argument("--latency-scale-s", type=float, default=0.2, help="latency scale per env step, s")
    parser.add_argument("--latency-max-s", type=float, default=5.0, help="cap on one step's latency, s")
    parser.add_argument("--target-success", type=float, default=None, help="fixed target train success")
    parser.add_argument("--target-fraction", type=float, default=0.8, help="of the final sync success")
    parser.add_argument("--window", type=int, default=3, help="steps in the trailing success mean")
    parser.add_argument("--out-dir", type=Path, default=None, help="run dirs (default: beside --json)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit per run, seconds")
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


def run_mode(args: argparse.Namespace, mode: str, out_dir: Path) -> Path:
    """`launch.py run` for one mode; returns its run directory. A failed run raises with its log's tail."""
    run_dir = (out_dir / mode).resolve()
    if run_dir.exists():
        raise UsageError(f"{run_dir} exists: choose an empty --out-dir")
    cmd = [
        sys.executable,
        "-m",
        "rollart_hpc.entry.cli",
        "run",
        str(args.config.resolve()),
        "--run-dir",
        str(run_dir),
    ]
    cmd += [*args.overrides, *mode_overrides(args, mode)]
    log = out_dir / f"{mode}.log"
    print(f"[{mode}] {' '.join(cmd[3:])}", flush=True)
    with log.open("w", encoding="utf-8") as fh:
        rc = subprocess.run(
            cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout_s
        ).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(encoding="utf-8").splitlines()[-15:])
        raise RuntimeError(f"bench e2e: the {mode} run failed (exit {rc}); log {log}:\n{tail}")
    return run_dir


# ---- analysis ---------------------------------------------------------------------------------------
def trailing_means(values: list[float], window: int) -> list[float]:
    """Mean of each value and the up to window - 1 values before it."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i + 1 - window) : i + 1]
        out.append(sum(part) / len(part))
    return out


def pick_target(args: argparse.Namespace, sync_rows: list[dict[str, Any]]) -> dict[str, Any]:
    if args.target_success is not None:
        value, how = float(args.target_success), "fixed (--target-success)"
    else:
        tail = [float(r["train_success"]) for r in sync_rows[-args.window :]]
        final = sum(tail) / len(tail)
        value = args.target_fraction * final
        how = f"{args.target_fraction} x final sync success {final:.4f} (mean of its last {len(tail)} steps)"
    note = "" if value > 0 else "target <= 0: the sync run shows no success to reach; times are undefined"
    return {"value": value, "how": how, "window": args.window, "defined": value > 0, "note": note}


def time_to_target(rows: list[dict[str, Any]], target: dict[str, Any]) -> float | None:
    if not target["defined"]:
        return None
    means = trailing_means([float(r["train_success"]) for r in rows], int(target["window"]))
    return next((float(r["wall_s"]) for r, m in zip(rows, means, strict=True) if m >= target["value"]), None)


def mode_result(run_dir: Path, target: dict[str, Any]) -> dict[str, Any]:
    from rollart_hpc.metrics.report import busy_fractions, load_run, overall_throughput, write_report
    from rollart_hpc.metrics.timeline import role_busy_fractions, window

    run = load_run(run_dir)
    span = window(run.timelines)
    write_report(run_dir)
    t = overall_throughput(run.rows)
    return {
        "run_dir": str(run_dir),
        "steps": len(run.rows),
        "trained_trajectories": sum(int(r["trained_trajectories"]) for r in run.rows),
        "tokens": sum(int(r.get("tokens", 0)) for r in run.rows),
        "wall_s": t["wall_s"],
        "trajectories_per_s": t["trajectories_per_s"],
        "tokens_per_s": t["tokens_per_s"],
        "final_success": run.rows[-1]["train_success"] if run.rows else None,
        "time_to_target_s": time_to_target(run.rows, target),
        "busy_fraction_by_role": role_busy_fractions(run.timelines, *span) if span else {},
        "busy_fraction_by_rank": busy_fractions(run),
        "staleness": (run.summary or {}).get("staleness", {}),
        "balanced": (run.summary or {}).get("balanced"),
    }


def add_speedups(results: dict[str, dict[str, Any]]) -> None:
    sync = results["sync"]
    for r in results.values():
        ttt, sync_ttt = r["time_to_target_s"], sync["time_to_target_s"]
        r["speedup_time_to_target"] = sync_ttt / ttt if ttt and sync_ttt else None
        r["speedup_throughput"] = r["trajectories_per_s"] / sync["trajectories_per_s"]
        r["speedup_wall"] = sync["wall_s"] / r["wall_s"]


# ---- plots ------------------------------------------------------------------------------------------
def plot_reward(run_dirs: dict[str, Path], target: dict[str, Any], path: Path) -> Path:
    from rollart_hpc.metrics.report import load_run, pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, run_dir in run_dirs.items():
        rows = load_run(run_dir).rows
        means = trailing_means([float(r["train_success"]) for r in rows], int(target["window"]))
        ax.plot([r["wall_s"] for r in rows], means, marker=".", label=mode)
    if target["defined"]:
        ax.axhline(target["value"], color="grey", linestyle="--", label="target")
    ax.set(
        xlabel="wall-clock since RL start (s)", ylabel=f"train success (trailing mean of {target['window']})"
    )
    ax.set_title("training success vs wall-clock")
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
    if not 0 < args.target_fraction <= 1:
        raise UsageError(f"--target-fraction must lie in (0, 1], got {args.target_fraction}")
    if not args.config.is_file():
        raise UsageError(f"--config: {args.config} is not a file")
    stray = [o for o in args.overrides if "=" not in o]
    if stray:
        raise UsageError(f"overrides must be key=value, got {' '.join(stray)}")
    return ["sync", *[m for m in MODES if m in modes and m != "sync"]]


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    modes = check_args(args)
    out_dir = args.out_dir or args.json.with_name(args.json.stem + "-runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dirs = {mode: run_mode(args, mode, out_dir) for mode in modes}
    from rollart_hpc.metrics.report import load_run

    target = pick_target(args, load_run(run_dirs["sync"]).rows)
    results = {mode: mode_result(run_dir, target) for mode, run_dir in run_dirs.items()}
    add_speedups(results)
    plots = {
        "reward": str(plot_reward(run_dirs, target, args.json.with_name(args.json.stem + "-reward.png"))),
        "utilisation": str(
            plot_utilisation(run_dirs, args.json.with_name(args.json.stem + "-utilisation.png"))
        ),
    }
    workload = {
        "config": str(args.config),
        "steps": args.steps,
        "batch": args.batch,
        "latency": {"dist": args.latency, "scale_s": args.latency_scale_s, "max_s": args.latency_max_s},
        "overrides": list(args.overrides),
    }
    return {"workload": workload, "target": target, "modes": results, "plots": plots}


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.contracts.atomic import atomic_write_json

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
