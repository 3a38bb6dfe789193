"""`launch.py resume RUN_DIR [--max-restarts N]`: restart a stopped or crashed local run from its last complete checkpoint.

The run directory's resolved config is used as it is (no overrides: the run must stay the run it was).
Every rank starts again; the controller finds the newest checkpoint, truncates the trajectory store and
metrics back to it, dispatches again the trajectories that were in flight, and continues. Before that,
the model, the checkpoint (written under the same config) and the trajectory store are checked
(`restarts.check_resumable_run`): bad input ends with one line and changes nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry import restarts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory of an earlier `launch.py run`")
    restarts.add_argument(parser)


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.config import read_resolved
    from rollart_hpc.config.resolve import RESOLVED_NAME
    from rollart_hpc.controller.checkpoint import latest
    from rollart_hpc.entry.launcher import run_world_outcome

    run_dir = Path(args.run_dir).resolve()
    max_restarts = restarts.checked_count(args.max_restarts)
    if not (run_dir / RESOLVED_NAME).exists():
        raise UsageError(f"{run_dir} is not a run directory (no {RESOLVED_NAME})")
    if (run_dir / "summary.json").exists():
        raise UsageError(f"{run_dir} holds a finished run (summary.json); nothing to resume")
    config = read_resolved(run_dir)
    if config.run.job != "rl":
        raise UsageError(f"only RL runs resume; {run_dir} ran job {config.run.job!r}")
    plan = make_plan(config.roles)
    restarts.check_resumable_run(run_dir, config)
    checkpoint = latest(run_dir)
    where = f"checkpoint {checkpoint.name}" if checkpoint else "the start (no checkpoint yet)"
    print(f"resuming {run_dir} from {where}\n{plan.table()}", flush=True)
    return restarts.run_with_restarts(
        run_dir,
        lambda: run_world_outcome(run_dir, plan.world_size, config.cluster.launch_timeout_s),
        max_restarts,
        lambda: restarts.check_resumable_run(run_dir, config),
    )
