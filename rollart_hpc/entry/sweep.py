"""`launch.py sweep CONFIG --grid key=v1,v2 ... --seeds 0,1,2 --out DIR`: a grid of runs over seeds.

Every combination of the grid's values (the product over `--grid` keys, in the order given) is an *arm*;
every arm runs once per seed (`run.seed`). Each run is an ordinary run directory
`DIR/<arm>/seed=<s>` (arm = `key=value` pairs joined by `__`, `base` without a grid; characters other
than letters, digits and `._=+-` become `_`), made and launched exactly as `launch.py run` does (a
subprocess `run CONFIG --set... grid... run.seed=S --run-dir RUN_DIR`). `DIR/sweep.json` lists every run
with its arm, seed and overrides (`launch.py compare DIR` reads it).

Resumable: on a rerun with the same DIR, a finished run (its finish marker, `summary.json`, exists) is
skipped; a started one (resolved config plus outputs or a checkpoint) continues from its last complete
checkpoint through `launch.py resume RUN_DIR` (the same path as by hand); any other run starts fresh. A
run dir whose resolved config differs from the one the sweep resolves now is refused (one line).

Locally `--parallel N` runs at a time (subprocesses, default 1); each run's console output is in
`RUN_DIR/sweep.log`. A failing run is reported with its log and the others go on; the exit code is 1
if any run failed. Ctrl-C or SIGTERM stop every started run (SIGTERM, by pid: each launcher then ends
its world) before the sweep exits.

With `--slurm` the runs still to do are ONE job array (`#SBATCH --array=0-K`,
`slurm/templates/array.sbatch.in`): element i execs `RUN_DIR/job.sbatch`, the single-component script
`launch.py submit --dry-run --out` writes for that run (`rollart_hpc.cluster.sbatch.render_job`: stop
signal traps, the srun step with srun_watch, restarts after a failed step, requeue of that element on
preemption), with its output in `RUN_DIR/slurm-<element job id>.out`. SLURM has no arrays of
heterogeneous jobs, so every role must sit on one partition (the error says so otherwise).

`--shared-warm-start` (local sweeps): the arms of one seed start from one warm start instead of one each.
Per seed, a warm-start run `DIR/warm/seed=<s>` (the config with `controller.num_steps=1` and no evaluation)
is run first (or reused once finished); every arm's run of that seed then starts from its warm model
(`model.source="path"`, `model.path=DIR/warm/seed=<s>/model/warm`, `trainer.sft_steps=0`). So the arms are
compared from the same initial policy, and the sweep spends one warm start per seed. A grid key that changes
the warm start (under `model.`, `envs.`, `roles.`, `run.`, or `trainer.sft_`) is refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rollart_hpc.cluster.restarts import checked_count
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry import restarts
from rollart_hpc.entry.options import RUN_CONFIG_HELP
from rollart_hpc.sweep.array import ArrayOptions
from rollart_hpc.sweep.grid import SEED_KEY, check_shared_warm_start, parse_grid, parse_seeds
from rollart_hpc.sweep.run import Sweep, run_sweep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help=RUN_CONFIG_HELP)
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a dotted config key and its values (repeat for a product grid)",
    )
    parser.add_argument("--seeds", default="0", help="comma-separated run.seed values (default 0)")
    parser.add_argument("--out", required=True, help="sweep directory (one run dir per arm and seed)")
    parser.add_argument("--parallel", type=int, default=1, help="local runs at a time (default 1)")
    parser.add_argument("--slurm", action="store_true", help="submit the runs as one SLURM job array")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run"
    )
    parser.add_argument("--time-min", type=int, default=60, help="--slurm: minutes per element (default 60)")
    parser.add_argument(
        "--max-requeues", type=int, default=3, help="--slurm: requeues per element after a stop (default 3)"
    )
    parser.add_argument("--nodes", type=int, default=1, help="--slurm: nodes per element (default 1)")
    parser.add_argument(
        "--shared-warm-start",
        action="store_true",
        help="the arms of a seed start from one warm start, run first (local sweeps)",
    )
    restarts.add_argument(parser)


# --- entry --------------------------------------------------------------------------------------------


def check_options(args: argparse.Namespace) -> None:
    checked_count(args.max_restarts)
    if args.parallel < 1:
        raise UsageError(f"--parallel must be >= 1, got {args.parallel}")
    if args.time_min < 1 or args.max_requeues < 0 or args.nodes < 1:
        raise UsageError("--time-min and --nodes must be >= 1, --max-requeues >= 0")
    for text in args.set:
        if "=" not in text:
            raise UsageError(f"--set {text!r}: expected KEY=VALUE")
    if args.shared_warm_start:
        if args.slurm:
            raise UsageError("--shared-warm-start runs the warm starts locally first; not with --slurm")
        check_shared_warm_start(parse_grid(args.grid))
    grid_keys = {key for key, _ in parse_grid(args.grid)}
    clash = sorted(grid_keys & {t.partition("=")[0].strip() for t in args.set})
    if clash or SEED_KEY in {t.partition("=")[0].strip() for t in args.set}:
        raise UsageError(f"--set {(clash or [SEED_KEY])[0]}: this key is swept (--grid / --seeds)")


def main(args: argparse.Namespace) -> int:
    check_options(args)
    array = None
    if args.slurm:
        array = ArrayOptions(args.nodes, args.time_min, args.max_requeues, restarts.check_resumable_run)
    sweep = Sweep(
        config=args.config,
        sets=tuple(args.set),
        grid=tuple((key, tuple(values)) for key, values in parse_grid(args.grid)),
        seeds=tuple(parse_seeds(args.seeds)),
        out=Path(args.out).resolve(),
        parallel=args.parallel,
        max_restarts=args.max_restarts,
        shared_warm_start=args.shared_warm_start,
        array=array,
    )
    return run_sweep(sweep)
