"""The arms of a sweep side by side: each run's curves from its `metrics.jsonl`, the areas and final values
with bootstrap intervals per arm, the paired differences to a reference arm, the markdown table and the
PNG of the curves. What each number is: `rollart_hpc.entry.compare` (the command `launch.py compare`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.metrics.run_metrics import METRICS_FILE, read_rows

COMPARE_MD = "compare.md"
COMPARE_PNG = "compare.png"
GRID_POINTS = 50
AXES = (("step", "step"), ("trained", "trained trajectories"), ("wall_s", "wall-clock (s)"))
EVAL_SERIES = ("eval_success", "heldout_success")  # eval-row series besides the main eval_success


@dataclass
class RunCurves:
    """One run's success points: each a dict with `step`, `trained`, `wall_s` and `success`."""

    name: str
    arm: str
    seed: int
    train: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    eval_from_train: bool = False
    series: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # every other success series

    @property
    def eval_points(self) -> list[dict[str, float]]:
        return self.evals if self.evals else self.train


@dataclass(frozen=True)
class Interval:
    mean: float
    ci_low: float
    ci_high: float
    n: int

    def as_dict(self) -> dict[str, float | int]:
        return {"mean": self.mean, "ci_low": self.ci_low, "ci_high": self.ci_high, "n": self.n}

    def text(self) -> str:
        return f"{self.mean:.3f} [{self.ci_low:.3f}, {self.ci_high:.3f}]" if self.n else "-"


# --- reading ------------------------------------------------------------------------------------------


def discover(sweep_dir: Path) -> list[tuple[str, str, int]]:
    """(run dir relative to DIR, arm, seed) of every run: sweep.json's, else every metrics.jsonl's."""
    listing = sweep_dir / "sweep.json"
    if listing.exists():
        try:
            rows = json.loads(listing.read_text())["runs"]
            return [(str(r["run_dir"]), str(r["arm"]), int(r["seed"])) for r in rows]
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"{listing}: not a sweep listing ({exc})") from None
    found = []
    for index, path in enumerate(sorted(sweep_dir.rglob(METRICS_FILE))):
        rel = path.parent.relative_to(sweep_dir)
        if rel.name.startswith("seed=") and rel.name[5:].lstrip("-").isdigit():
            found.append((str(rel), str(rel.parent) if str(rel.parent) != "." else "base", int(rel.name[5:])))
        else:
            found.append((str(rel), str(rel), index))
    return found


def step_rows(path: Path) -> list[dict[str, Any]]:
    """The metrics rows of a file that carry a `step` (others are a warning and skipped)."""
    rows = []
    for row in read_rows(path, skip_bad=True):
        if isinstance(row.get("step"), int | float):
            rows.append(row)
        else:
            print(f"warning: {path}: metrics row without a step skipped", file=sys.stderr)
    return rows


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def curves(name: str, arm: str, seed: int, rows: Sequence[dict[str, Any]]) -> RunCurves:
    """Train and eval points of a run's rows. Trained trajectories are `count/trained` where rows have it,
    else the running sum of `trained_trajectories`. An eval row (`kind = "eval"`, `step` = the version it
    evaluated) sits at x = that version; its own `wall_s` and `count/trained` where it has them, else those
    of the train row that made the version (version 0, before training: 0 and 0 s)."""
    run = RunCurves(name, arm, seed)
    at_version: dict[float, dict[str, float]] = {0.0: {"trained": 0.0, "wall_s": 0.0}}
    total = 0.0
    train_rows = [r for r in rows if r.get("kind") != "eval"]
    for row in sorted(train_rows, key=lambda r: float(r["step"])):
        step = float(row["step"])
        total += _number(row.get("trained_trajectories")) or 0.0
        trained = _number(row.get("count/trained"))
        success = _number(row.get("train_success"))
        if success is not None:
            point = {"step": step, "trained": total if trained is None else trained}
            point["wall_s"] = _number(row.get("wall_s")) or 0.0
            at_version[_number(row.get("version")) or step + 1] = point
            run.train.append({**point, "success": success})
            _add_series(run, row, point, ("train_success",))
    for row in rows:
        success = _number(row.get("eval_success"))
        if success is None:
            continue
        version = _number(row.get("version")) or float(row["step"])
        known = at_version.get(version, {"trained": float("nan"), "wall_s": float("nan")})
        own = {"trained": _number(row.get("count/trained")), "wall_s": _number(row.get("wall_s"))}
        point = {k: known[k] if v is None else v for k, v in own.items()}
        run.evals.append({"step": version, **point, "success": success})
        _add_series(run, row, {"step": version, **point}, EVAL_SERIES)
    run.evals.sort(key=lambda p: p["step"])
    for points in run.series.values():
        points.sort(key=lambda p: p["step"])
    run.eval_from_train = not run.evals
    return run


def _add_series(
    run: RunCurves, row: dict[str, Any], point: dict[str, float], prefixes: tuple[str, ...]
) -> None:
    """The row's success values whose key is one of `prefixes` or `<prefix>/<family>` (eval_success itself
    is the main curve and not repeated), each appended to its series at `point`."""
    for key, value in row.items():
        success = _number(value)
        if success is None or key == "eval_success" or key.partition("/")[0] not in prefixes:
            continue
        run.series.setdefault(key, []).append({**point, "success": success})


def load_runs(sweep_dir: Path) -> list[RunCurves]:
    if not sweep_dir.is_dir():
        raise UsageError(f"{sweep_dir} is not a directory")
    runs = []
    for rel, arm, seed in discover(sweep_dir):
        path = sweep_dir / rel / METRICS_FILE
        rows = step_rows(path)
        run = curves(rel, arm, seed, rows)
        if not run.eval_points:
            print(f"warning: {path}: no metrics rows; run {rel} left out", file=sys.stderr)
            continue
        runs.append(run)
    if not runs:
        raise UsageError(
            f"{sweep_dir}: no run with metrics rows (run `launch.py sweep ... --out {sweep_dir}`)"
        )
    return runs


# --- statistics ---------------------------------------------------------------------------------------


def area(points: Sequence[dict[str, float]]) -> float:
    """Mean success over the step range: trapezoid area / (last step - first step); one point: its value."""
    import numpy as np

    steps = np.array([p["step"] for p in points])
    values = np.array([p["success"] for p in points])
    if len(points) == 1 or steps[-1] == steps[0]:
        return float(values.mean())
    return float(np.trapezoid(values, steps) / (steps[-1] - steps[0]))


def final(points: Sequence[dict[str, float]], window: int) -> float:
    import numpy as np

    return float(np.mean([p["success"] for p in points[-window:]]))


def bootstrap(values: Sequence[float], resamples: int, seed: int) -> Interval:
    """Mean and 95% percentile bootstrap interval of the mean (resampling the values with replacement)."""
    import numpy as np

    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(float(data.mean()), float(low), float(high), int(data.size))


def arm_table(runs: Sequence[RunCurves]) -> dict[str, list[RunCurves]]:
    arms: dict[str, list[RunCurves]] = {}
    for run in runs:
        arms.setdefault(run.arm, []).append(run)
    return arms


def statistics(
    arms: dict[str, list[RunCurves]], reference: str, window: int, resamples: int, seed: int
) -> dict[str, dict[str, Any]]:
    """Per arm: area/final intervals over seeds and paired differences to the reference arm."""
    per_seed = {
        arm: {r.seed: (area(r.eval_points), final(r.eval_points, window)) for r in runs}
        for arm, runs in arms.items()
    }
    out: dict[str, dict[str, Any]] = {}
    for arm, values in per_seed.items():
        shared = sorted(set(values) & set(per_seed[reference]))
        stats: dict[str, Any] = {
            "seeds": sorted(values),
            "eval_from_train": [r.seed for r in arms[arm] if r.eval_from_train],
        }
        for index, key in enumerate(("area_eval_success", "final_eval_success")):
            stats[key] = bootstrap([v[index] for v in values.values()], resamples, seed).as_dict()
            diffs = [values[s][index] - per_seed[reference][s][index] for s in shared]
            stats[f"{key}_diff_vs_reference"] = bootstrap(diffs, resamples, seed).as_dict()
        stats["series"] = series_statistics(arms[arm], arms[reference], resamples, seed)
        out[arm] = stats
    return out


def series_statistics(
    runs: Sequence[RunCurves], reference: Sequence[RunCurves], resamples: int, seed: int
) -> dict[str, dict[str, Any]]:
    """Per series of the arm's runs: the area's interval over seeds and its paired difference to the
    reference arm's runs of the same seeds (where they have the series)."""
    ref = {r.seed: r.series for r in reference}
    out: dict[str, dict[str, Any]] = {}
    for key in sorted({k for r in runs for k in r.series}):
        areas = {r.seed: area(r.series[key]) for r in runs if r.series.get(key)}
        diffs = [a - area(ref[s][key]) for s, a in sorted(areas.items()) if ref.get(s, {}).get(key)]
        out[key] = {
            "area": bootstrap(list(areas.values()), resamples, seed).as_dict(),
            "area_diff_vs_reference": bootstrap(diffs, resamples, seed).as_dict(),
        }
    return out


# --- output -------------------------------------------------------------------------------------------


def _interval(data: dict[str, Any]) -> str:
    return Interval(**data).text()


def markdown(stats: dict[str, dict[str, Any]], reference: str, window: int, resamples: int) -> str:
    lines = [
        "| arm | seeds | area eval success | final eval success | Δ area vs ref | Δ final vs ref |",
        "|---|---|---|---|---|---|",
    ]
    for arm, s in stats.items():
        marker = " (ref)" if arm == reference else ""
        lines.append(
            f"| {arm}{marker} | {','.join(map(str, s['seeds']))} | {_interval(s['area_eval_success'])} | "
            f"{_interval(s['final_eval_success'])} | {_interval(s['area_eval_success_diff_vs_reference'])} | "
            f"{_interval(s['final_eval_success_diff_vs_reference'])} |"
        )
    lines += [
        "",
        f"Mean over seeds [95% bootstrap interval, {resamples} resamples]. Area: the area under the eval-success "
        "curve over steps divided by the step range (mean eval success). "
        f"Final: mean of the last {window} eval point(s). Δ: paired by seed against {reference}.",
    ]
    fallback = [f"{arm} seeds {s['eval_from_train']}" for arm, s in stats.items() if s["eval_from_train"]]
    if fallback:
        lines.append(f"No eval rows, train_success used instead: {'; '.join(fallback)}.")
    if any(s["series"] for s in stats.values()):
        lines += ["", "| arm | series | area | Δ area vs ref |", "|---|---|---|---|"]
        for arm, s in stats.items():
            for key, v in s["series"].items():
                diff = _interval(v["area_diff_vs_reference"])
                lines.append(f"| {arm} | {key} | {_interval(v['area'])} | {diff} |")
        lines += [
            "",
            "Area of each series the runs' rows carry (training success per step, per-family and held-out eval).",
        ]
    return "\n".join(lines) + "\n"


def mean_std_curve(points: Sequence[Sequence[dict[str, float]]], axis: str) -> tuple[Any, Any, Any] | None:
    """Each run's success interpolated onto a common grid of `axis`: (grid, mean, std); None if empty."""
    import numpy as np

    series = []
    for run_points in points:
        xs = np.array([p[axis] for p in run_points])
        ys = np.array([p["success"] for p in run_points])
        keep = ~np.isnan(xs)
        if keep.any():
            series.append((xs[keep], ys[keep]))
    if not series:
        return None
    low, high = max(s[0].min() for s in series), min(s[0].max() for s in series)
    grid = np.linspace(low, high, GRID_POINTS) if high > low else np.array([low])
    values = np.stack([np.interp(grid, xs, ys) for xs, ys in series])
    return grid, values.mean(axis=0), values.std(axis=0)


def plot(arms: dict[str, list[RunCurves]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(AXES), figsize=(5 * len(AXES), 8), squeeze=False)
    for row, (kind, label) in enumerate((("train", "train success"), ("eval", "eval success"))):
        for col, (axis, xlabel) in enumerate(AXES):
            ax = axes[row][col]
            for arm, runs in arms.items():
                pts = [r.train if kind == "train" else r.eval_points for r in runs]
                curve = mean_std_curve(pts, axis)
                if curve is None:
                    continue
                grid, mean, std = curve
                (line,) = ax.plot(
                    grid, mean, marker="." if len(grid) == 1 else None, label=f"{arm} (n={len(runs)})"
                )
                ax.fill_between(grid, mean - std, mean + std, color=line.get_color(), alpha=0.2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle("mean ± std over seeds")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
