"""`launch.py eval RUN_DIR [--checkpoint step-N] [--samples K] [--greedy]`: evaluate a checkpoint of a run.

The evaluation runs as its own local MPI world in `RUN_DIR/evals/step-NNNNNN/`, under the run's resolved
config with `run.job = "eval"`: the same trainer (restoring the checkpoint), rollout, env and reward
ranks as the run, and a controller that plays one evaluation round and stops (`controller.eval_main`).
The round covers every training task and the held-out tasks (`envs.num_heldout`). The result goes to
`RUN_DIR/eval-step-NNNNNN.json` (atomic) and is printed as a table. The run's own files are only read
(its initial model is linked into the evaluation world, never copied or changed).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory of an earlier `launch.py run`")
    parser.add_argument("--checkpoint", help="checkpoint to evaluate, e.g. step-10 (default: the last)")
    parser.add_argument("--samples", type=int, default=None, help="episodes per task (default: the run's)")
    parser.add_argument("--greedy", action="store_true", help="also play every task greedily")


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.cluster.supervise import run_world_outcome
    from rollart_hpc.config import write_resolved
    from rollart_hpc.contracts.atomic import atomic_write_json
    from rollart_hpc.controller.eval_main import REQUEST, RESULT

    run_dir = Path(args.run_dir).resolve()
    config = run_config(run_dir)
    checkpoint = find_checkpoint(run_dir, args.checkpoint)
    version = int(checkpoint.name.split("-")[1])
    c = config.controller
    samples = c.eval_samples if args.samples is None else args.samples
    if samples < 1:
        raise UsageError(f"--samples must be >= 1, got {samples}")
    controller = dataclasses.replace(c, eval_samples=samples, eval_greedy=c.eval_greedy or args.greedy)
    config = dataclasses.replace(
        config, run=dataclasses.replace(config.run, job="eval"), controller=controller
    )
    world_dir = RunLayout(run_dir).evals / checkpoint.name
    link_model(run_dir, world_dir, config.model.source)
    write_resolved(config, world_dir)
    request = {"run_dir": str(run_dir), "checkpoint": str(checkpoint), "version": version}
    atomic_write_json(world_dir / REQUEST, request)
    (world_dir / RESULT).unlink(missing_ok=True)
    plan = make_plan(config.roles)
    print(f"evaluating {checkpoint} in {world_dir}\n{plan.table()}", flush=True)
    outcome = run_world_outcome(world_dir, plan.world_size, config.cluster.launch_timeout_s)
    if outcome.code:
        return outcome.code
    result = json.loads((world_dir / RESULT).read_text())
    out = run_dir / f"eval-{checkpoint.name}.json"
    atomic_write_json(out, result)
    print(eval_table(result["row"]))
    print(f"evaluation written to {out}")
    return 0


def run_config(run_dir: Path) -> Any:
    """The run's resolved config; UsageError (one line) unless `run_dir` holds an RL run."""
    from rollart_hpc.config import read_resolved
    from rollart_hpc.config.resolve import RESOLVED_NAME

    if not (run_dir / RESOLVED_NAME).is_file():
        raise UsageError(f"{run_dir} is not a run directory (no {RESOLVED_NAME})")
    config = read_resolved(run_dir)
    if config.run.job != "rl":
        raise UsageError(f"only RL runs have checkpoints to evaluate; {run_dir} ran job {config.run.job!r}")
    if "household" in config.envs.families:
        from rollart_hpc.tasks.families.household_data import is_ready

        if not (is_ready() and is_ready(heldout=True)):
            raise UsageError(
                "household games (or their held-out split) are not prepared: run `launch.py envs prepare`"
            )
    return config


def find_checkpoint(run_dir: Path, name: str | None) -> Path:
    """The complete checkpoint `name` (step-N, any zero padding) or, without a name, the newest one."""
    from rollart_hpc.controller import checkpoint as ckpt

    if name is None:
        path = ckpt.latest(run_dir)
        if path is None:
            raise UsageError(f"{run_dir} has no complete checkpoint to evaluate")
        return path
    match = re.fullmatch(r"(?:step-)?(\d+)", name)
    if match is None:
        raise UsageError(f"--checkpoint: {name!r} is not of the form step-N")
    path = ckpt.step_dir(run_dir, int(match.group(1)))
    if not ckpt.complete(path):
        found = ", ".join(
            p.name for p in sorted(ckpt.checkpoints_dir(run_dir).glob("step-*")) if ckpt.complete(p)
        )
        raise UsageError(
            f"--checkpoint: no complete checkpoint {path.name} in {run_dir} (found: {found or 'none'})"
        )
    return path


def link_model(run_dir: Path, world_dir: Path, source: str) -> None:
    """The run's initial model (`model/init`, which the trainers restore the checkpoint onto), linked
    into the evaluation world so that it is reused, not made again."""
    if source == "path":
        return  # the config names the model directory itself
    init = RunLayout(run_dir).model / "init"
    if not (init / "config.json").is_file():
        raise UsageError(f"{run_dir} has no initial model ({init / 'config.json'} is missing)")
    link = world_dir / "model" / "init"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(init, target_is_directory=True)


def eval_table(row: dict[str, Any]) -> str:
    """The round's success per split and family as a table (rich, plain text)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=100, file=io.StringIO())  # rendered once, by the caller
    table = Table(title=f"evaluation of version {row['version']}")
    table.add_column("metric")
    table.add_column("success", justify="right")
    for key in sorted(k for k in row if "_success" in k):
        table.add_row(key, f"{row[key]:.3f}")
    table.add_row("episodes (failed)", f"{row['eval_episodes']} ({row['eval_failed']})")
    console.print(table)
    return console.export_text()
