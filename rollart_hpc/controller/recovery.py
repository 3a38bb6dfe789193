"""The controller rank's side of run checkpoints: when one is due, writing it, resuming from one.

Order of a save: the trainers write their part first (CHECKPOINT -> CHECKPOINTED, each trainer rank);
then the controller's state and the COMPLETE marker (`controller.checkpoint`), so a checkpoint that a
reader trusts always holds both parts. A save happens only while no step is with the trainers.
Resuming restores the core, truncates the HDF5 store and metrics.jsonl back to the checkpoint, and
queues the tickets that were in flight to be dispatched again, so nothing is counted twice. Evaluation
rounds are not part of a checkpoint: their rows of versions >= the checkpoint's go with the truncation,
and the resumed run evaluates the checkpoint's version again when it is due.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

from rollart_hpc.cluster import signals
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.controller import checkpoint as ckpt
from rollart_hpc.controller.state import Controller
from rollart_hpc.metrics.run_metrics import MetricsWriter, truncate_metrics


def checkpoint_due(controller: Controller, now: float | None = None) -> bool:
    """A stop was requested, or at a version not yet checkpointed the step interval is reached or
    `checkpoint_every_s` seconds have passed since the last checkpoint (or the start)."""
    c = controller.config.controller
    version = controller.core.version
    new = version > controller.last_checkpoint
    periodic = c.checkpoint_every_steps > 0 and version % c.checkpoint_every_steps == 0 and new
    elapsed = (time.monotonic() if now is None else now) - controller.last_checkpoint_at
    timed = c.checkpoint_every_s > 0 and new and elapsed >= c.checkpoint_every_s
    return controller.stop_requested.is_set() or periodic or timed


def check_stop_grace() -> None:
    """A SIGTERM's grace is over before its checkpoint began: fail (the last complete checkpoint stands)."""
    if signals.past_grace():
        raise RuntimeError(
            "SIGTERM: no checkpoint within cluster.sigterm_grace_s; the last complete one stands"
        )


def state_dict(controller: Controller) -> dict[str, Any]:
    return {
        "core": controller.core.state_dict(),
        "store": controller.store.position().as_dict(),
        "loaded_history": controller.loaded_history,
        "wall_s": controller.wall_s(),
    }


def save(controller: Controller) -> Path:
    """Trainers save their part first; the controller's state and the COMPLETE marker come last. With
    `controller.checkpoint_async` the trainers write in the background and training goes on: the state
    taken now waits in `controller.unwritten` until every trainer rank reports its part written."""
    ctx = controller.ctx
    began = time.time()
    path = ckpt.step_dir(ctx.run_dir, controller.core.version)
    path.mkdir(parents=True, exist_ok=True)
    for rank in ctx.ranks["trainer"]:
        ctx.mailbox.send(str(path / "trainer"), rank, Tag.CHECKPOINT)
    state = pickle.loads(pickle.dumps(state_dict(controller)))  # as it is now, not when written
    controller.unwritten[path] = (state, set(ctx.ranks["trainer"]), began)
    controller.last_checkpoint = controller.core.version
    controller.last_checkpoint_at = time.monotonic()
    if not controller.config.controller.checkpoint_async:
        for rank in ctx.ranks["trainer"]:
            controller.handle(ctx.mailbox.wait_for(Tag.CHECKPOINTED, source=rank))
        complete_written(controller)
    # `s`: how long the controller handled no message for it (what the simulator calibrates on)
    controller.trace.write("checkpoint", version=controller.core.version, s=round(time.time() - began, 6))
    return path


def complete_written(controller: Controller) -> None:
    """Mark complete (controller state, then COMPLETE) every begun checkpoint that all trainer ranks have
    reported written, oldest first; prune; log each with the trainer bytes it holds per rank."""
    ctx = controller.ctx
    for path in sorted(p for p, (_, ranks, _) in controller.unwritten.items() if not ranks):
        state, _, began = controller.unwritten.pop(path)
        ckpt.write_controller_state(path, state, controller.config)
        ckpt.prune(ctx.run_dir, controller.config.controller.keep_checkpoints)
        per_rank = ckpt.trainer_bytes_per_rank(path)
        version = state["core"]["version"]
        written_s = round(time.time() - began, 6)
        controller.trace.write("checkpoint_complete", version=version, s=written_s, bytes_per_rank=per_rank)
        ctx.log.info(f"checkpoint at version {version}: {path} (trainer bytes per rank: {per_rank})")


def restart_metrics(controller: Controller, version: int) -> None:
    """metrics.jsonl back to `version`; the kept rows seed the success-by-family summary."""
    controller.metrics.close()
    for row in truncate_metrics(controller.ctx.run_dir, version):
        controller.note_success(row)
    controller.metrics = MetricsWriter(controller.ctx.run_dir)


def start_fresh(controller: Controller) -> None:
    """No checkpoint: whatever an earlier attempt wrote before its first checkpoint is discarded."""
    from rollart_hpc.store.trajectories import StorePosition  # h5py

    if controller.store.position().rows:
        controller.ctx.log.info("no checkpoint in the run directory: starting over")
    controller.store.truncate_to(StorePosition(0, 0, 0))
    restart_metrics(controller, 0)


def resume(controller: Controller, path: Path) -> None:
    """Continue from a checkpoint: state back, store and metrics truncated, in-flight tickets queued again."""
    from rollart_hpc.store.trajectories import StorePosition  # h5py

    ckpt.check_fingerprint(path, controller.config)
    state = ckpt.read_controller_state(path)
    core = controller.core
    core.load_state_dict(state["core"])
    controller.store.truncate_to(StorePosition(**state["store"]))
    restart_metrics(controller, core.version)
    controller.loaded_history = {int(k): list(v) for k, v in state["loaded_history"].items()}
    controller.loaded = dict.fromkeys(controller.loaded, core.version)
    controller.redispatch = list(core.in_flight.values())
    controller.wall_offset = float(state["wall_s"])
    controller.last_checkpoint = core.version
    controller.evaluator.resume(core.version)
    controller.ctx.log.info(
        f"resumed from {path}: version {core.version}, {len(controller.redispatch)} trajectories to dispatch again"
    )


def resume_or_start(controller: Controller, run_dir: Path) -> Path | None:
    """Drop partial and damaged checkpoints, then resume from the newest valid one (returned) or start
    fresh."""
    for partial in ckpt.discard_incomplete(run_dir):
        controller.ctx.log.info(f"removed incomplete checkpoint {partial}")
    path = ckpt.latest_valid(run_dir, controller.ctx.log.warning)
    if path is not None:
        resume(controller, path)
    else:
        start_fresh(controller)
    return path
