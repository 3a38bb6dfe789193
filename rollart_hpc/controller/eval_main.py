"""Controller rank of a standalone evaluation world (`launch.py eval`, `run.job = "eval"`).

The world is an RL run's world that only evaluates: the trainers restore the checkpoint named in
`eval_request.json` (their READY names the model they now hold), the rollout, env and reward ranks start
with those weights at the checkpoint's version, and the controller plays one evaluation round (every
training task `eval_samples` times, greedily too with `eval_greedy`, and the held-out tasks) through the
same ranks as a run's periodic rounds (`controller.evaluation`). Nothing is trained; the round's row
goes to this world's `metrics.jsonl` and to `eval.json` (written atomically), then every rank stops.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rollart_hpc.cluster.context import RunContext
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.controller.evaluation import Evaluator
from rollart_hpc.controller.shutdown import shutdown
from rollart_hpc.controller.startup import start_workers
from rollart_hpc.controller.state import Controller
from rollart_hpc.tasks.build import heldout_tasks, run_tasks

REQUEST = "eval_request.json"  # written by `launch.py eval`: run_dir, checkpoint, version
RESULT = RunLayout.EVAL_RESULT_NAME


def evaluate(controller: Controller, version: int) -> dict:
    """Play one round of `version` (the weights every rollout rank holds) to its end; its row."""
    mailbox, evaluator = controller.ctx.mailbox, controller.evaluator
    evaluator.start(version)
    while evaluator.active:
        for msg in mailbox.poll():
            controller.handle(msg)
        controller.dispatch(training=False)
        mailbox.check()
        time.sleep(0.0005)
    return evaluator.rows[-1]


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    request = json.loads((run_dir / REQUEST).read_text())
    tasks, c = run_tasks(config.envs), config.controller
    controller = Controller(config, ctx, tasks)
    controller.evaluator = Evaluator(
        tasks,
        heldout_tasks(config.envs),
        every_steps=1,
        samples=c.eval_samples,
        greedy=c.eval_greedy,
        seed=config.run.seed,
    )
    version = int(request["version"])
    start_workers(config, ctx, run_dir, Path(request["checkpoint"]), version)
    ctx.log.info(f"evaluating {request['checkpoint']} (version {version})")
    controller.started = time.monotonic()
    row = evaluate(controller, version)
    shutdown(controller)
    controller.store.close()
    controller.metrics.close()
    atomic_write_json(run_dir / RESULT, {**request, "row": row})
