"""`launch.py chaos CONFIG [key=value ...] --trials N --seed S --json OUT`: fault injection against the
automatic recovery of local runs. The trials, the faults and what each trial checks: `rollart_hpc.chaos.trials`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rollart_hpc.chaos.trials import format_table, make_setup, run_trials
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry.options import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "dotted overrides (applied after the chaos defaults)")
    parser.add_argument("--trials", type=int, default=6, help="runs, one fault each (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the faults, ranks and times (default 0)")
    parser.add_argument("--json", required=True, help="write the table of trials here")
    parser.add_argument("--work-dir", help="run directories go here (default runs/chaos-<timestamp>)")
    parser.add_argument("--max-restarts", type=int, default=3, help="per trial (default 3)")
    parser.add_argument("--trial-timeout-s", type=float, default=900.0, help="per trial (default 900)")


def main(args: argparse.Namespace) -> int:
    if args.trials < 1 or args.max_restarts < 1:
        raise UsageError("--trials and --max-restarts must be >= 1")
    setup = make_setup(args.config, args.overrides, args.max_restarts, args.trial_timeout_s)
    work = Path(args.work_dir or f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if work.exists() and any(work.iterdir()):
        raise UsageError(f"work dir {work} is not empty; choose a new --work-dir")
    work.mkdir(parents=True, exist_ok=True)
    result = run_trials(setup, work, args.trials, args.seed)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result), flush=True)
    return 0 if result["survived"] == result["trials"] else 1
