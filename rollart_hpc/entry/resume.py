"""`launch.py resume RUN_DIR [KEY=VALUE ...] [--max-restarts N]`: restart a stopped or crashed local run from its last complete checkpoint.

The run directory's resolved config is used as it is: the run must stay the run it was. Only the
trainer's layout may change (`LAYOUT_KEYS`: trainer ranks, tensor and pipeline parallel sizes, the
distributed optimizer and gradient overlap); the trainer checkpoint is stored under global keys and loads
at any layout. Such overrides are validated like `run`'s and rewrite the resolved files before the start.
Every rank starts again; the controller finds the newest checkpoint, truncates the trajectory store and
metrics back to it, dispatches again the trajectories that were in flight, and continues. Before that,
the model, the checkpoint (written under the same config) and the trajectory store are checked
(`restarts.check_resumable_run`): bad input ends with one line and changes nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rollart_hpc.cluster.restarts import checked_count, run_with_restarts
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.entry import restarts

LAYOUT_KEYS = (
    "roles.trainer.num_ranks",
    "trainer.tensor_parallel",
    "trainer.pipeline_parallel",
    "trainer.distributed_optimizer",
    "trainer.overlap_grad_reduce",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory of an earlier `launch.py run`")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help=f"a new trainer layout: {', '.join(LAYOUT_KEYS)}"
    )
    restarts.add_argument(parser)


def _relayout(run_dir: Path, overrides: list[str]) -> None:
    """Apply trainer-layout overrides to the run's resolved config (validated, written atomically)."""
    from rollart_hpc.config.resolve import RESOLVED_NAME, load_config, write_resolved

    for item in overrides:
        if item.split("=", 1)[0] not in LAYOUT_KEYS:
            raise UsageError(
                f"resume override {item!r}: only the trainer layout may change ({', '.join(LAYOUT_KEYS)})"
            )
    write_resolved(load_config(run_dir / RESOLVED_NAME, overrides), run_dir)


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.cluster.supervise import run_world_outcome
    from rollart_hpc.config import read_resolved
    from rollart_hpc.config.resolve import RESOLVED_NAME
    from rollart_hpc.controller.checkpoint import latest

    run_dir = Path(args.run_dir).resolve()
    max_restarts = checked_count(args.max_restarts)
    if not (run_dir / RESOLVED_NAME).exists():
        raise UsageError(f"{run_dir} is not a run directory (no {RESOLVED_NAME})")
    if RunLayout(run_dir).summary.exists():
        raise UsageError(f"{run_dir} holds a finished run (summary.json); nothing to resume")
    if args.overrides:
        _relayout(run_dir, args.overrides)
    config = read_resolved(run_dir)
    if config.run.job != "rl":
        raise UsageError(f"only RL runs resume; {run_dir} ran job {config.run.job!r}")
    plan = make_plan(config.roles)
    restarts.check_resumable_run(run_dir, config)
    checkpoint = latest(run_dir)
    where = f"checkpoint {checkpoint.name}" if checkpoint else "the start (no checkpoint yet)"
    print(f"resuming {run_dir} from {where}\n{plan.table()}", flush=True)
    return run_with_restarts(
        run_dir,
        lambda: run_world_outcome(run_dir, plan.world_size, config.cluster.launch_timeout_s),
        max_restarts,
        lambda: restarts.check_resumable_run(run_dir, config),
        restarts.checkpoint_step,
    )
