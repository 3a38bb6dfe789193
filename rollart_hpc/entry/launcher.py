"""`launch.py run CONFIG [overrides] [--run-dir DIR] [--dry-run]`: one local MPI world via mpiexec.

The launcher resolves the config once, checks the run's inputs, writes the config to the run directory,
and runs the world under the supervision of `rollart_hpc/cluster/supervise.py` (mpiexec in its own
session, every rank's process tracked, the failing rank and role named, nothing left behind). With
`--max-restarts N` a failed world is restarted from its last checkpoint (`entry/restarts.py`).
"""

from __future__ import annotations

import argparse

from rollart_hpc.cluster.restarts import checked_count, run_with_restarts
from rollart_hpc.cluster.supervise import check_inputs, run_world_outcome
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RUN_OUTPUTS
from rollart_hpc.entry import restarts
from rollart_hpc.entry.options import add_config_arguments, add_run_dir_argument, resolve_run_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "dotted overrides, e.g. trainer.lr=1e-6")
    add_run_dir_argument(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the resolved plan and exit")
    restarts.add_argument(parser)


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.config import load_config, write_resolved

    config = load_config(args.config, args.overrides)
    max_restarts = checked_count(args.max_restarts)
    plan = make_plan(config.roles)
    if args.dry_run:
        from rollart_hpc.cluster.placement import placement_table, predict_local

        print(f"run {config.run.name!r} job {config.run.job!r}")
        print(plan.table())
        print(placement_table(predict_local(plan)))
        return 0
    run_dir = resolve_run_dir(args, config.run.name)
    held = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if held:
        raise UsageError(f"run dir {run_dir} already holds a run ({', '.join(held)}); choose a new --run-dir")
    check_inputs(config)
    write_resolved(config, run_dir)
    print(f"run dir {run_dir}\n{plan.table()}", flush=True)
    timeout_s = config.cluster.launch_timeout_s
    return run_with_restarts(
        run_dir,
        lambda: run_world_outcome(run_dir, plan.world_size, timeout_s),
        max_restarts,
        lambda: restarts.check_resumable_run(run_dir, config),
        restarts.checkpoint_step,
    )
