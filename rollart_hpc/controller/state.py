"""The controller rank's state and its reactions: results, trained steps, loaded versions, dispatch, batches.

Single-threaded (driven by `controller.loop.run`). Messages are folded into the `ControllerCore`; every
trajectory that arrives is appended to the HDF5 store, and its final status (trained at version n /
dropped with cause / failed with cause) is marked there. The controller keeps its own record of which
env rank holds which episode (`env_of`), so a result frees exactly the slot its dispatch took.
Evaluation episodes (`controller.evaluation`) share the env slots: a RESULT with an evaluation id frees
its slot and goes to the `Evaluator` only (never to the core or the store). While a round runs it may
hold up to half of all env slots when training also wants them (all of them when training cannot
dispatch); in sync mode training dispatch waits for the round (evaluation between steps).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_hpc.cluster import signals
from rollart_hpc.cluster.context import RunContext
from rollart_hpc.cluster.mailbox import Message
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.contracts.records import EpisodeTicket, RankStats, StepReport, Trajectory
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.controller.batching import batch_advantages, batch_stats, shard_batch
from rollart_hpc.controller.core import ControllerCore, CoreSettings
from rollart_hpc.controller.evaluation import Evaluator
from rollart_hpc.metrics.run_metrics import MetricsWriter, eval_line, progress_line
from rollart_hpc.metrics.trace import TraceWriter
from rollart_hpc.tasks.build import heldout_tasks
from rollart_hpc.tasks.episodes import is_eval_episode
from rollart_hpc.tasks.types import Task

if TYPE_CHECKING:
    from rollart_hpc.store.trajectories import TrajectoryStore


class Controller:
    """What the controller rank holds between messages (see the module docstring)."""

    def __init__(self, config: Config, ctx: RunContext, tasks: list[Task]) -> None:
        from rollart_hpc.store.trajectories import TrajectoryStore  # h5py

        self.config, self.ctx = config, ctx
        task_ids = [t.id for t in tasks]
        settings = CoreSettings.from_config(config.controller, config.algo)
        self.core = ControllerCore.build(settings, task_ids, config.run.seed)
        self.store: TrajectoryStore = TrajectoryStore(RunLayout(ctx.run_dir).trajectories)
        c = config.controller
        heldout = heldout_tasks(config.envs) if c.eval_every_steps else []
        self.evaluator = Evaluator(
            tasks,
            heldout,
            every_steps=c.eval_every_steps,
            samples=c.eval_samples,
            greedy=c.eval_greedy,
            seed=config.run.seed,
        )
        self.metrics = MetricsWriter(ctx.run_dir)
        self.trace = TraceWriter(ctx.run_dir)  # what the scale simulator calibrates on
        self.env_load = dict.fromkeys(ctx.ranks["env"], 0)
        self.env_of: dict[str, int] = {}  # episode id -> the env rank it was dispatched to
        self.loaded = dict.fromkeys(ctx.ranks["rollout"], 0)
        self.loaded_history: dict[int, list[int]] = {rank: [0] for rank in ctx.ranks["rollout"]}
        self.trainer_busy = False
        self.pending_row: dict[str, Any] = {}
        self.started = time.monotonic()
        self.busy: dict[str, float] = {}
        self.rebuilds: dict[str, dict[str, int]] = {}  # 'role rank r' -> failures and rebuilds inside it
        self.first_success: dict[str, float] = {}
        self.last_success: dict[str, float] = {}
        self.redispatch: list[EpisodeTicket] = []
        self.last_checkpoint = 0  # version of the last checkpoint written or resumed from
        self.last_checkpoint_at = time.monotonic()  # when it was written (or this attempt began)
        # Checkpoints begun, not yet complete: path -> its controller state and the trainer ranks still
        # writing (trainer.checkpoint_async; `recovery.complete_written` marks them complete).
        self.unwritten: dict[Path, tuple[dict[str, Any], set[int], float]] = {}
        self.wall_offset = 0.0
        self.stop_requested = signals.STOP_REQUESTED  # SIGUSR1/SIGUSR2: checkpoint, then exit

    # ---- messages -------------------------------------------------------------------------------
    def handle(self, msg: Message) -> None:
        if msg.tag == Tag.RESULT:
            self.on_result(msg.payload)
        elif msg.tag == Tag.TRAINED:
            self.on_trained(msg.payload)
        elif msg.tag == Tag.LOADED:
            self.loaded[msg.source] = int(msg.payload)
            self.loaded_history[msg.source].append(int(msg.payload))
            self.trace.write("loaded", rank=msg.source, version=int(msg.payload))
            self.update_rollout_version()
        elif msg.tag == Tag.CHECKPOINTED:
            self.unwritten[Path(msg.payload).parent][1].discard(msg.source)
        elif msg.tag == Tag.STATS:
            stats: RankStats = msg.payload
            key = f"{stats.role} rank {msg.source}"
            self.busy[key] = self.busy.get(key, 0.0) + stats.busy_s
            if stats.role in ("rollout", "reward"):
                self.rebuilds[key] = {"failures": stats.failures, "rebuilds": stats.rebuilds}
        else:
            raise RuntimeError(f"controller: unexpected message tag {msg.tag} from rank {msg.source}")

    def update_rollout_version(self) -> None:
        # LOADED(n+1) from a rollout rank may overtake TRAINED(n) from the trainer (different sources).
        self.core.on_rollout_version(min(min(self.loaded.values()), self.core.version))

    def on_result(self, traj: Trajectory) -> None:
        rank = self.env_of.pop(traj.episode_id, None)
        if rank is not None:
            self.env_load[rank] -= 1
        if is_eval_episode(traj.episode_id):
            self.on_eval_result(traj)
            return
        outcome = self.core.on_result(traj)
        if outcome == "ignored":
            return
        self.store.append([traj], [time.time()])
        self.trace.result(traj, float(traj.dispatch.get("dispatch_time") or 0.0))
        if outcome == "failed":
            self.store.mark([traj.episode_id], "failed", self.core.version, traj.failure_cause)
        elif outcome == "dropped":
            self.store.mark([traj.episode_id], "dropped", self.core.version, self.core.last_drop_cause)
        self.log_redundant()

    def cancel_stragglers(self) -> None:
        """Redundancy: end the due episodes still running once a batch's results are in."""
        for episode_id in self.core.stragglers():
            rank = self.env_of.get(episode_id)
            if rank is not None:
                self.ctx.mailbox.send(episode_id, rank, Tag.CANCEL)

    def log_redundant(self) -> None:
        """run_dir/redundant.jsonl: every episode dropped by redundancy (task, length, reward so far);
        surplus results cut from a batch are marked in the store here (aborted ones on their return)."""
        records = self.core.redundancy.take()
        if not records:
            return
        surplus = [r["episode_id"] for r in records if r["when"] == "surplus"]
        if surplus:
            self.store.mark(surplus, "dropped", self.core.version, "redundant")
        with RunLayout(self.ctx.run_dir).redundant.open("a") as fh:
            fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)

    def on_trained(self, report: StepReport) -> None:
        step = report.step
        ids = list(self.core.training.get(step, []))
        self.core.on_published(step + 1)
        self.trace.write("trained", step=step)
        self.update_rollout_version()
        self.store.mark(ids, "trained", step, "")
        self.trainer_busy = False
        row = {**self.pending_row, **report.row()}
        row.update(step=step, version=step + 1, wall_s=self.wall_s())
        row.update({f"count/{k}": v for k, v in self.counts().items()})
        self.metrics.log(row)
        self.note_success(row)
        self.ctx.log.info(progress_line(row, self.core.num_steps))

    def note_success(self, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if key.startswith("train_success/"):
                self.first_success.setdefault(key.split("/", 1)[1], value)
                self.last_success[key.split("/", 1)[1]] = value

    def wall_s(self) -> float:
        return self.wall_offset + time.monotonic() - self.started

    def counts(self) -> dict[str, int]:
        acc = self.core.accounting()
        return {
            "dispatched": acc["dispatched"],
            "trained": acc["trained"],
            "in_flight": acc["in_flight"],
            "dropped": sum(acc["dropped"].values()),
            "failed": sum(acc["failed"].values()),
        }

    # ---- actions --------------------------------------------------------------------------------
    def on_eval_result(self, traj: Trajectory) -> None:
        row = self.evaluator.on_result(traj)
        if row is not None:  # every step trains batch_size trajectories: the count at the version evaluated
            row["count/trained"] = row["version"] * self.config.controller.batch_size
            row["wall_s"] = self.wall_s()
            self.metrics.log(row)
            self.ctx.log.info(eval_line(row))

    def start_due_eval(self, final: bool = False) -> None:
        """Start an evaluation round of the version every rollout engine holds, when one is due."""
        version = self.core.rollout_version
        ev = self.evaluator
        if ev.final_due(version) if final else ev.due(version):
            count = ev.start(version)
            self.ctx.log.info(f"evaluation of version {version}: {count} episodes")

    def next_ticket(self, training: bool) -> EpisodeTicket | None:
        """Training tickets (re-dispatched ones first), evaluation tickets when a round runs (see the
        module docstring for their share of the env slots)."""
        ev = self.evaluator
        slots = self.config.envs.num_slots * len(self.env_load)
        if ev.active and (not training or ev.in_flight < max(1, slots // 2)):
            ticket = ev.next_ticket()
            if ticket is not None:
                return ticket
        if not training or (ev.active and self.config.controller.mode == "sync"):
            return None
        ticket = self.redispatch.pop(0) if self.redispatch else self.core.dispatch()
        return ticket if ticket is not None else ev.next_ticket()

    def dispatch(self, training: bool = True) -> None:
        """Send tickets to the least-loaded env ranks while admission and env slots allow."""
        capacity = self.config.envs.num_slots
        while True:
            rank = min(self.env_load, key=lambda r: (self.env_load[r], r))
            if self.env_load[rank] >= capacity:
                return
            ticket = self.next_ticket(training)
            if ticket is None:
                return
            self.env_load[rank] += 1
            self.env_of[ticket.episode_id] = rank
            self.ctx.mailbox.send(ticket, rank, Tag.DISPATCH)

    def train(self, checkpoint_due: bool) -> None:
        """Hand the next batch to the idle trainers (not while a checkpoint is due)."""
        if self.trainer_busy or checkpoint_due:
            return
        self.cancel_stragglers()
        batch = self.core.next_batch()
        self.log_redundant()
        if batch is None:
            return
        advantages, diagnostics = batch_advantages(batch, self.config.algo)
        trainers = self.ctx.ranks["trainer"]
        for rank, shard in zip(trainers, shard_batch(batch, advantages, len(trainers)), strict=True):
            self.ctx.mailbox.send(shard, rank, Tag.BATCH)
        self.pending_row = {**batch_stats(batch), **{f"adv/{k}": v for k, v in diagnostics.items()}}
        self.trace.write(
            "batch", step=batch.step, tokens=sum(len(r.trajectory.token_ids) for r in batch.results)
        )
        self.trainer_busy = True
