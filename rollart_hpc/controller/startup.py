"""Start-up of an RL run from the controller rank: the initial model, then START/READY with every rank.

The trainers get START first (the initial model and, on a resume, their checkpoint part); once the
first trainer is READY with the model it now holds (warm-started or restored), the rollout, env and
reward ranks get START with that model and its version, and the controller waits for each one's READY.
"""

from __future__ import annotations

from pathlib import Path

from rollart_hpc.cluster.context import RunContext
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.contracts.records import Ready, TrainerStart, WorkerStart
from rollart_hpc.controller.model_prep import prepare_model


def start_workers(config: Config, ctx: RunContext, run_dir: Path, resume: Path | None, version: int) -> Path:
    """START the trainers with the initial model (and the checkpoint to resume from); once they are warm
    (or restored), START everyone else with the trainers' current weights at `version`."""
    mailbox, ranks = ctx.mailbox, ctx.ranks
    model_init = prepare_model(config, run_dir)
    ctx.log.info(f"initial model ready at {model_init}")
    trainer_part = str(resume / "trainer") if resume is not None else None
    for rank in ranks["trainer"]:
        mailbox.send(TrainerStart(str(model_init), trainer_part), rank, Tag.START)
    ready: Ready = mailbox.wait_for(Tag.READY, source=ranks["trainer"][0]).payload
    if ready.model_dir is None:
        raise RuntimeError("the first trainer reported READY without its model directory")
    current = Path(ready.model_dir)
    for rank in ranks["trainer"][1:]:
        mailbox.wait_for(Tag.READY, source=rank)
    ctx.log.info(f"trainers ready at version {version}: {current}")
    others = ranks["rollout"] + ranks["env"] + ranks["reward"]
    for rank in others:
        mailbox.send(WorkerStart(str(current), version), rank, Tag.START)
    for rank in others:
        mailbox.wait_for(Tag.READY, source=rank)
    return current
