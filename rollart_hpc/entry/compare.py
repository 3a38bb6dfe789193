"""`launch.py compare DIR [--json OUT] [--reference ARM] [--png OUT]`: the arms of a sweep, side by side.

Runs come from `DIR/sweep.json` (`launch.py sweep`), else from every `metrics.jsonl` under DIR (the arm is
the path of a `seed=<n>` directory's parent). An arm is a grid combination; its runs differ by seed.

Per run, from `metrics.jsonl`: the eval points (evaluation rounds' rows, `kind = "eval"` with
`eval_success`, at the version they evaluated) and the train points (rows with `train_success`), each
against the step, the trajectories trained so far (`count/trained`) and `wall_s`. A run without eval rows uses its train_success instead (said in the output). Per run:
- area: the area under the eval-success curve over steps (trapezoids) divided by the step range, i.e. the
  mean eval success over the run (the value itself when there is one point);
- final: the mean eval success of the last `--final-window` eval points (default 1: the last point);
- the area of every other series the rows carry, the same way: `train_success` (the paper's
  training-reward area) and its per-family `train_success/<family>`, and the eval rows' per-family
  `eval_success/<family>`, `heldout_success` and `heldout_success/<family>`.
Per arm: the mean over seeds with a 95% percentile bootstrap interval (seeds resampled with
replacement, `--resamples` times, numpy RNG seeded by `--bootstrap-seed`), and the paired difference to
the reference arm (per seed present in both, the same bootstrap over the differences).

Writes `DIR/compare.md` (the table, also printed), a PNG (`--png`, default `DIR/compare.png`: mean ±
std over seeds of train and eval success against steps, trained trajectories and wall-clock seconds,
each run interpolated onto a common grid over the range all its arm's runs cover) and with `--json` per
arm `area_eval_success` and `final_eval_success` (each {mean, ci_low, ci_high, n}) under `arms`, and
`series`: per series its `area` and `area_diff_vs_reference` (the second table of compare.md). A
corrupt metrics line is a one-line warning naming the file and line; the run still counts if it has rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.sweep.compare import (
    COMPARE_MD,
    COMPARE_PNG,
    arm_table,
    load_runs,
    markdown,
    plot,
    statistics,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="sweep directory (launch.py sweep --out)")
    parser.add_argument("--json", help="write per-arm statistics as JSON to this file")
    parser.add_argument("--reference", help="arm the others are compared with (default: the first arm)")
    parser.add_argument("--png", help=f"the curves' PNG (default DIR/{COMPARE_PNG})")
    parser.add_argument(
        "--final-window", type=int, default=1, help="eval points averaged as final (default 1)"
    )
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (default 10000)")
    parser.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the bootstrap RNG (default 0)")


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.contracts.atomic import atomic_write_bytes, atomic_write_json

    if args.final_window < 1 or args.resamples < 1:
        raise UsageError("--final-window and --resamples must be >= 1")
    sweep_dir = Path(args.dir).resolve()
    arms = arm_table(load_runs(sweep_dir))
    reference = args.reference or next(iter(arms))
    if reference not in arms:
        raise UsageError(f"--reference {reference!r} is not an arm; arms: {', '.join(arms)}")
    stats = statistics(arms, reference, args.final_window, args.resamples, args.bootstrap_seed)
    text = markdown(stats, reference, args.final_window, args.resamples)
    print(text, end="", flush=True)
    atomic_write_bytes(sweep_dir / COMPARE_MD, text.encode())
    png = Path(args.png) if args.png else sweep_dir / COMPARE_PNG
    plot(arms, png)
    print(f"wrote {sweep_dir / COMPARE_MD} and {png}", flush=True)
    if args.json:
        result = {
            "reference": reference,
            "final_window": args.final_window,
            "resamples": args.resamples,
            "arms": stats,
        }
        atomic_write_json(Path(args.json), result)
        print(f"wrote {args.json}", flush=True)
    return 0
