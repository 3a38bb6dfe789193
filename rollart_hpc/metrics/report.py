"""`launch.py report RUN_DIR [--out DIR]`: PNG plots and a markdown summary of one run.

Reads only what the run writes for readers: `config.resolved.toml`, `metrics.jsonl` (one row per
optimizer step), `summary.json` (only once the run has finished) and `timeline/rank-<r>.json` (written
by each role rank when its loop ends). It works on a run that is still going: a last metrics line that
is being written is skipped, and plots whose inputs do not exist yet are left out and named as missing
in `report.md`. Output goes to RUN_DIR/report/ (or --out): success.png, throughput.png, staleness.png,
timeline.png and report.md. matplotlib runs with the Agg backend (no display).
"""

from __future__ import annotations

import argparse
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.metrics.run_metrics import read_metrics
from rollart_hpc.metrics.timeline import RankTimeline, busy_fraction, merge_intervals, read_timelines, window


@dataclass
class RunData:
    """What a report is made of; `summary` is None while the run is going."""

    run_dir: Path
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    summary: dict[str, Any] | None
    timelines: list[RankTimeline] = field(default_factory=list)
    eval_rows: list[dict[str, Any]] = field(default_factory=list)  # evaluation rounds, by version

    @property
    def num_steps(self) -> int:
        return int(self.config.get("controller", {}).get("num_steps", 0))

    @property
    def finished(self) -> bool:
        return self.summary is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="a run directory (holds config.resolved.toml)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/report)")


def main(args: argparse.Namespace) -> int:
    out = write_report(args.run_dir, args.out)
    print(f"report written to {out}")
    return 0


# ---- reading ------------------------------------------------------------------------------------
def load_run(run_dir: Path) -> RunData:
    """Read a run directory; UsageError (one line) when it is not one."""
    run_dir = Path(run_dir)
    config_path = RunLayout(run_dir).config
    if not config_path.is_file():
        raise UsageError(f"{run_dir} is not a run directory (no config.resolved.toml)")
    config = tomllib.loads(config_path.read_text(encoding="utf-8"))
    summary_path = RunLayout(run_dir).summary
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.exists() else None
    # Optimizer steps and evaluation rounds (kind "eval", see run_metrics.is_eval_row) apart.
    every = read_metrics(run_dir)
    rows = [r for r in every if r.get("kind") != "eval"]
    evals = sorted((r for r in every if r.get("kind") == "eval"), key=lambda r: int(r["version"]))
    return RunData(run_dir, config, rows, summary, read_timelines(run_dir), evals)


# ---- derived numbers ------------------------------------------------------------------------------
def families(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("train_success/")})


def step_throughput(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per step: its wall time (since the previous step) and trajectories/s and tokens/s over it."""
    out, previous = [], 0.0
    for r in rows:
        dt = float(r["wall_s"]) - previous
        previous = float(r["wall_s"])
        trajs, tokens = float(r.get("trained_trajectories", 0)), float(r.get("tokens", 0))
        out.append(
            {
                "step": float(r["step"]),
                "step_s": dt,
                "trajectories_per_s": trajs / dt if dt > 0 else 0.0,
                "tokens_per_s": tokens / dt if dt > 0 else 0.0,
            }
        )
    return out


def overall_throughput(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Trained trajectories and tokens per second of RL wall-clock, over all steps so far."""
    if not rows:
        return {"trajectories_per_s": 0.0, "tokens_per_s": 0.0, "wall_s": 0.0}
    wall = float(rows[-1]["wall_s"])
    trajs = sum(float(r.get("trained_trajectories", 0)) for r in rows)
    tokens = sum(float(r.get("tokens", 0)) for r in rows)
    return {"trajectories_per_s": trajs / wall, "tokens_per_s": tokens / wall, "wall_s": wall}


def busy_fractions(run: RunData) -> dict[str, float]:
    """Per rank ('role rank r'): share of the timeline window in which it was busy (union of intervals).

    Without timeline files (older runs), the summary's busy seconds over the run's wall time."""
    span = window(run.timelines)
    if span is not None:
        return {f"{t.role} rank {t.rank}": busy_fraction(t.intervals, *span) for t in run.timelines}
    if run.summary is not None and run.summary.get("wall_s"):
        wall = float(run.summary["wall_s"])
        return {name: float(s) / wall for name, s in run.summary.get("time_split_s", {}).items()}
    return {}


# ---- plots ----------------------------------------------------------------------------------------
def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_success(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, (ax_step, ax_wall) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in [("train_success", "all")] + [(f"train_success/{f}", f) for f in families(rows)]:
        pts = [(r["step"], r["wall_s"], r[key]) for r in rows if key in r]
        ax_step.plot([p[0] for p in pts], [p[2] for p in pts], marker=".", label=label)
        ax_wall.plot([p[1] for p in pts], [p[2] for p in pts], marker=".", label=label)
    ax_step.set(xlabel="optimizer step", ylabel="train success", title="success per family vs step")
    ax_wall.set(xlabel="wall-clock since RL start (s)", ylabel="train success", title="vs wall-clock")
    ax_step.legend()
    return save_figure(fig, path)


def plot_throughput(rows: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    per_step = step_throughput(rows)
    fig, (ax_t, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [p["step"] for p in per_step]
    ax_t.bar(steps, [p["trajectories_per_s"] for p in per_step])
    ax_t.set(xlabel="optimizer step", ylabel="trajectories / s", title="trained trajectories per second")
    ax_k.bar(steps, [p["tokens_per_s"] for p in per_step], color="tab:orange")
    ax_k.set(xlabel="optimizer step", ylabel="tokens / s", title="trained tokens per second")
    return save_figure(fig, path)


def plot_staleness(run: RunData, path: Path) -> Path:
    """The finished run's histogram; while it runs, the per-step mean staleness of trained batches."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    if run.summary is not None:
        hist = {int(k): int(v) for k, v in run.summary.get("staleness", {}).items()}
        ax.bar(list(hist), list(hist.values()))
        ax.set(xlabel="staleness n - v0 (versions)", ylabel="trained trajectories", title="staleness")
        ax.set_xticks(list(hist))
    else:
        ax.bar([r["step"] for r in run.rows], [r.get("mean_staleness", 0.0) for r in run.rows])
        ax.set(xlabel="optimizer step", ylabel="mean staleness", title="mean staleness (run going)")
    return save_figure(fig, path)


def plot_timeline(timelines: list[RankTimeline], path: Path, title: str = "busy timeline per rank") -> Path:
    """One row per rank, a bar wherever it was busy; intervals closer than 1/2000 of the span are joined."""
    plt = pyplot()
    span = window(timelines)
    if span is None:
        raise ValueError("plot_timeline needs at least one recorded interval")
    t0, t1 = span
    resolution = (t1 - t0) / 2000
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(timelines) + 1.5))
    for row, t in enumerate(timelines):
        bars = [(s - t0, e - s) for s, e in _coarse(t.intervals, resolution)]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=f"C{row % 10}")
    ax.set_yticks(range(len(timelines)))
    ax.set_yticklabels([f"{t.role} {t.rank} ({busy_fraction(t.intervals, t0, t1):.0%})" for t in timelines])
    ax.set(xlabel="seconds since the first recorded interval", title=title)
    ax.invert_yaxis()
    return save_figure(fig, path)


def _coarse(intervals: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in merge_intervals(intervals):
        if out and s - out[-1][1] <= gap:
            out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def save_figure(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path


# ---- report ---------------------------------------------------------------------------------------
def make_plots(run: RunData, out: Path) -> tuple[dict[str, Path], list[str]]:
    """The plots whose inputs exist, and a line for each one left out."""
    plots: dict[str, Path] = {}
    missing = []
    if run.rows:
        plots["success"] = plot_success(run.rows, out / "success.png")
        plots["throughput"] = plot_throughput(run.rows, out / "throughput.png")
        plots["staleness"] = plot_staleness(run, out / "staleness.png")
    else:
        missing.append("success, throughput, staleness: no optimizer step in metrics.jsonl yet")
    if window(run.timelines) is not None:
        plots["timeline"] = plot_timeline(run.timelines, out / "timeline.png")
    else:
        missing.append("timeline: no timeline/rank-*.json yet (ranks write them when their loop ends)")
    return plots, missing


def markdown(run: RunData, plots: dict[str, Path], missing: list[str]) -> str:
    c = run.config.get("controller", {})
    staleness = c.get("max_staleness", -1)
    if staleness == -1:
        staleness = {"sync": 0}.get(str(c.get("mode")), 1)
    state = "finished" if run.finished else "running (or stopped before its summary)"
    lines = [
        f"# Run report: {run.config.get('run', {}).get('name', run.run_dir.name)}",
        "",
        f"- directory: `{run.run_dir}`",
        f"- state: {state}; steps {len(run.rows)} / {run.num_steps}",
        f"- mode: {c.get('mode')}, max_staleness {staleness}, batch {c.get('batch_size')}",
    ]
    lines += _throughput_lines(run.rows) + _success_lines(run.rows) + _eval_lines(run.eval_rows)
    lines += _busy_lines(run)
    lines += _summary_lines(run.summary)
    lines += ["", "## Plots", ""] + [f"![{name}]({p.name})" for name, p in plots.items()]
    lines += [f"- not drawn: {m}" for m in missing]
    return "\n".join(lines) + "\n"


def _throughput_lines(rows: list[dict[str, Any]]) -> list[str]:
    t = overall_throughput(rows)
    return [
        f"- RL wall-clock: {t['wall_s']:.1f} s; {t['trajectories_per_s']:.3f} trajectories/s, "
        f"{t['tokens_per_s']:.1f} tokens/s (trained)"
    ]


def _success_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    out = ["", "## Train success (first step -> last step)", "", "| family | first | last |", "|---|---|---|"]
    for key, label in [("train_success", "all")] + [(f"train_success/{f}", f) for f in families(rows)]:
        vals = [r[key] for r in rows if key in r]
        out.append(f"| {label} | {vals[0]:.3f} | {vals[-1]:.3f} |")
    return out


def _eval_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One table row per evaluation round: success on the training tasks and on the held-out tasks."""
    if not rows:
        return []
    keys = sorted({k for r in rows for k in r if k.endswith("_success") or k.endswith("_success_greedy")})
    out = ["", "## Evaluation (uniform over tasks)", ""]
    out += ["| version | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in rows:
        cells = [f"{r[k]:.3f}" if k in r else "" for k in keys]
        out.append(f"| {r['version']} | " + " | ".join(cells) + " |")
    return out


def _busy_lines(run: RunData) -> list[str]:
    fractions = busy_fractions(run)
    if not fractions:
        return []
    title = (
        "Busy fraction per rank (timeline files: share of the window with work in progress)"
        if run.timelines
        else "Busy seconds / wall seconds per rank (summary; an env rank sums concurrent episodes)"
    )
    out = ["", f"## {title}", "", "| rank | busy |", "|---|---|"]
    return out + [f"| {name} | {value:.1%} |" for name, value in fractions.items()]


def _summary_lines(summary: dict[str, Any] | None) -> list[str]:
    if summary is None:
        return []
    out = ["", "## Trajectories", "", "| what | count |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in summary.get("trajectories", {}).items()]
    out += [f"| trained with staleness {k} | {v} |" for k, v in summary.get("staleness", {}).items()]
    out.append(f"| accounting balanced | {summary.get('balanced')} |")
    return out


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Plots and report.md for a run (finished or going); returns the path of report.md."""
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else RunLayout(run.run_dir).report
    out.mkdir(parents=True, exist_ok=True)
    plots, missing = make_plots(run, out)
    from rollart_hpc.contracts.atomic import atomic_write_bytes

    path = out / "report.md"
    atomic_write_bytes(path, markdown(run, plots, missing).encode())
    return path
