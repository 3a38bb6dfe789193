"""Controller rank of an RL run: build the controller, resume or start fresh, start the workers, run the
loop (`controller.loop`), evaluate the final version (when evaluation is on), stop every rank
(`controller.shutdown`) and write `summary.json`."""

from __future__ import annotations

import time
from pathlib import Path

from rollart_hpc.cluster.context import RunContext
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.controller import loop, recovery
from rollart_hpc.controller.shutdown import shutdown
from rollart_hpc.controller.startup import start_workers
from rollart_hpc.controller.state import Controller
from rollart_hpc.metrics.run_metrics import summary_table
from rollart_hpc.tasks.build import run_tasks


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    tasks = run_tasks(config.envs)
    controller = Controller(config, ctx, tasks)
    resume = recovery.resume_or_start(controller, run_dir)
    start_workers(config, ctx, run_dir, resume, controller.core.version)
    c = config.controller
    ctx.log.info(
        f"RL starts: {len(tasks)} tasks, mode {c.mode}, staleness {c.staleness}, "
        f"{c.num_steps} steps of {c.batch_size}"
    )
    controller.started = time.monotonic()
    controller.trace.write("start", num_steps=c.num_steps, batch_size=c.batch_size)
    stopped = loop.run(controller)
    if not stopped:
        loop.finish_evaluation(controller)
    summary = shutdown(controller)
    controller.store.close()
    controller.metrics.close()
    controller.trace.close()
    if stopped:
        ctx.log.info(f"stop requested: checkpointed at version {controller.core.version}; resume to continue")
        return
    atomic_write_json(RunLayout(run_dir).summary, summary)
    ctx.log.info("\n" + summary_table(summary))
    if not summary["balanced"]:
        raise RuntimeError(f"trajectory accounting is not balanced: {summary['accounting']}")
