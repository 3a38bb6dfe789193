"""Controller rank of an RL run: dispatch, admission, results, batches, metrics, store, shutdown.

One thread, one loop: poll the mailbox; fold RESULT/TRAINED/LOADED messages into the `ControllerCore`;
dispatch tickets to env ranks while admission and env slots allow; hand the next batch to the trainers
when they are idle; check peers' liveness. Every trajectory that arrives is appended to the HDF5 store,
and its final status (trained at version n / dropped with cause / failed with cause) is marked there.

Shutdown: after the last step, env ranks get STOP and return (or fail) what they have in flight; once
every env rank has reported, leftovers are dropped with cause 'run_end', then reward, rollout and trainer
ranks get STOP. The accounting is then balanced: dispatched = trained + dropped + failed.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from rollart_hpc.cluster import signals
from rollart_hpc.cluster.mailbox import Message
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts import protocol as proto
from rollart_hpc.controller.batching import batch_advantages, batch_stats, shard_batch
from rollart_hpc.controller.core import ControllerCore, ticket_to_dict
from rollart_hpc.rl_common import RunContext, run_tasks
from rollart_hpc.contracts.atomic import atomic_write_json


def make_core(config: Config, tasks: list[Any]) -> ControllerCore:
    from rollart_hpc.algo.sampler import TaskSampler
    from rollart_hpc.algo.tracker import EventTimeTracker, jeffreys_prior

    priors = {t.id: jeffreys_prior([]) for t in tasks}  # no offline outcomes: v = 0.5 per task
    a = config.algo
    tracker = EventTimeTracker(priors, rho=a.rho)
    sampler = TaskSampler(
        [t.id for t in tasks],
        tracker,
        epsilon=a.sampler_epsilon,
        max_in_flight_per_task=a.max_in_flight_per_task,
        seed=config.run.seed,
    )
    c = config.controller
    return ControllerCore(
        batch_size=c.batch_size,
        max_staleness=c.staleness,
        mode=c.mode,
        num_steps=c.num_steps,
        tracker=tracker,
        sampler=sampler,
        seed=config.run.seed,
    )


class Controller:
    def __init__(self, config: Config, ctx: RunContext, tasks: list[Any]) -> None:
        from rollart_hpc.metrics.run_metrics import MetricsWriter
        from rollart_hpc.store.trajectories import TrajectoryStore

        self.config, self.ctx = config, ctx
        self.core = make_core(config, tasks)
        self.families = {t.id: t.family for t in tasks}
        self.store = TrajectoryStore(ctx.run_dir / "trajectories.h5")
        self.metrics = MetricsWriter(ctx.run_dir)
        self.env_load = dict.fromkeys(ctx.ranks["env"], 0)
        self.loaded = dict.fromkeys(ctx.ranks["rollout"], 0)
        self.loaded_history: dict[int, list[int]] = {rank: [0] for rank in ctx.ranks["rollout"]}
        self.trainer_busy = False
        self.pending_row: dict[str, Any] = {}
        self.started = time.monotonic()
        self.busy: Counter[str] = Counter()
        self.first_success: dict[str, float] = {}
        self.last_success: dict[str, float] = {}
        self.redispatch: list[Any] = []
        self.last_checkpoint = 0  # tickets in flight at the checkpoint a run resumed from
        self.wall_offset = 0.0
        self.stop_requested = signals.STOP_REQUESTED  # SIGUSR1/SIGUSR2: checkpoint, then exit

    # ---- messages -------------------------------------------------------------------------------
    def handle(self, msg: Message) -> None:
        if msg.tag == proto.RESULT:
            self.on_result(msg.payload)
        elif msg.tag == proto.TRAINED:
            self.on_trained(msg.payload)
        elif msg.tag == proto.LOADED:
            self.loaded[msg.source] = int(msg.payload)
            self.loaded_history[msg.source].append(int(msg.payload))
            self.update_rollout_version()
        elif msg.tag == proto.STATS:
            self.busy[f"{msg.payload['role']} rank {msg.source}"] += msg.payload["busy_s"]
        else:
            raise RuntimeError(f"controller: unexpected message tag {msg.tag} from rank {msg.source}")

    def update_rollout_version(self) -> None:
        # LOADED(n+1) from a rollout rank may overtake TRAINED(n) from the trainer (different sources).
        self.core.on_rollout_version(min(min(self.loaded.values()), self.core.version))

    def on_result(self, traj: Any) -> None:
        self.env_load[int(traj.dispatch["env_rank"])] -= 1
        outcome = self.core.on_result(traj)
        if outcome == "ignored":
            return
        self.store.append([traj], [time.time()])
        if outcome == "failed":
            self.store.mark([traj.episode_id], "failed", self.core.version, traj.failure_cause)
        elif outcome == "dropped":
            self.store.mark([traj.episode_id], "dropped", self.core.version, "stale")

    def on_trained(self, report: dict[str, Any]) -> None:
        step = int(report["step"])
        ids = list(self.core.training.get(step, []))
        self.core.on_published(step + 1)
        self.update_rollout_version()
        self.store.mark(ids, "trained", step, "")
        self.trainer_busy = False
        row = {**self.pending_row, **{k: v for k, v in report.items() if k != "step"}}
        row.update(step=step, version=step + 1, wall_s=self.wall_s())
        row.update({f"count/{k}": v for k, v in self.counts().items()})
        self.metrics.log(row)
        self.note_success(row)
        from rollart_hpc.metrics.run_metrics import progress_line

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
    def dispatch(self) -> None:
        capacity = self.config.envs.num_slots
        while True:
            rank = min(self.env_load, key=lambda r: (self.env_load[r], r))
            if self.env_load[rank] >= capacity:
                return
            ticket = self.redispatch.pop(0) if self.redispatch else self.core.dispatch()
            if ticket is None:
                return
            payload = ticket_to_dict(ticket)
            payload.update(env_rank=rank, family=self.families[ticket.task_id])
            self.env_load[rank] += 1
            self.ctx.mailbox.send(payload, rank, proto.DISPATCH)

    def train(self) -> None:
        if self.trainer_busy or self.checkpoint_due():
            return
        batch = self.core.next_batch()
        if batch is None:
            return
        advantages, diagnostics = batch_advantages(batch, self.config.algo.advantage)
        trainers = self.ctx.ranks["trainer"]
        for rank, shard in zip(trainers, shard_batch(batch, advantages, len(trainers)), strict=True):
            self.ctx.mailbox.send(shard, rank, proto.BATCH)
        self.pending_row = {**batch_stats(batch), **{f"adv/{k}": v for k, v in diagnostics.items()}}
        self.trainer_busy = True

    def loop(self) -> bool:
        """Run until the last step, or until a requested stop has been checkpointed (returns True then)."""
        mailbox = self.ctx.mailbox
        while not self.core.done:
            for msg in mailbox.poll():
                self.handle(msg)
            if self.core.done:
                break  # the last step is in: a stop requested now simply ends a finished run
            if self.checkpoint_due() and not self.trainer_busy:
                self.checkpoint()
                if self.stop_requested.is_set():
                    return True
            self.dispatch()
            self.train()
            mailbox.check()
            time.sleep(0.0005)
        return False

    # ---- checkpoints ----------------------------------------------------------------------------
    def restart_metrics(self, version: int) -> None:
        from rollart_hpc.metrics.run_metrics import MetricsWriter, truncate_metrics

        self.metrics.close()
        for row in truncate_metrics(self.ctx.run_dir, version):
            self.note_success(row)
        self.metrics = MetricsWriter(self.ctx.run_dir)

    def start_fresh(self) -> None:
        """No checkpoint: whatever an earlier attempt wrote before its first checkpoint is discarded."""
        from rollart_hpc.store.trajectories import StorePosition

        if self.store.position().rows:
            self.ctx.log.info("no checkpoint in the run directory: starting over")
        self.store.truncate_to(StorePosition(0, 0, 0))
        self.restart_metrics(0)

    def checkpoint_due(self) -> bool:
        every = self.config.controller.checkpoint_every_steps
        periodic = every > 0 and self.core.version % every == 0 and self.core.version > self.last_checkpoint
        return self.stop_requested.is_set() or periodic

    def checkpoint(self) -> Path:
        """Trainers save their part first; the controller's state and the COMPLETE marker come last."""
        from rollart_hpc.controller import checkpoint as ckpt

        path = ckpt.step_dir(self.ctx.run_dir, self.core.version)
        path.mkdir(parents=True, exist_ok=True)
        for rank in self.ctx.ranks["trainer"]:
            self.ctx.mailbox.send(str(path / "trainer"), rank, proto.CHECKPOINT)
        for rank in self.ctx.ranks["trainer"]:
            self.ctx.mailbox.wait_for(proto.CHECKPOINTED, source=rank)
        state = {
            "core": self.core.state_dict(),
            "store": self.store.position().as_dict(),
            "loaded_history": self.loaded_history,
            "wall_s": self.wall_s(),
        }
        ckpt.write_controller_state(path, state)
        ckpt.prune(self.ctx.run_dir, self.config.controller.keep_checkpoints)
        self.last_checkpoint = self.core.version
        self.ctx.log.info(f"checkpoint at version {self.core.version}: {path}")
        return path

    def resume(self, path: Path) -> None:
        """Continue from a checkpoint: state back, store and metrics truncated, in-flight tickets queued again."""
        from rollart_hpc.controller import checkpoint as ckpt
        from rollart_hpc.store.trajectories import StorePosition

        state = ckpt.read_controller_state(path)
        self.core.load_state_dict(state["core"])
        self.store.truncate_to(StorePosition(**state["store"]))
        self.restart_metrics(self.core.version)
        self.loaded_history = {int(k): list(v) for k, v in state["loaded_history"].items()}
        self.loaded = dict.fromkeys(self.loaded, self.core.version)
        self.redispatch = list(self.core.in_flight.values())
        self.wall_offset = float(state["wall_s"])
        self.last_checkpoint = self.core.version
        self.ctx.log.info(
            f"resumed from {path}: version {self.core.version}, {len(self.redispatch)} trajectories to dispatch again"
        )

    def shutdown(self) -> dict[str, Any]:
        mailbox, ranks = self.ctx.mailbox, self.ctx.ranks
        for rank in ranks["env"]:
            mailbox.send("run end", rank, proto.STOP)
        pending = set(ranks["env"])
        while pending:
            for msg in [mailbox.wait_for(proto.STATS), *mailbox.poll()]:
                self.handle(msg)
                if msg.tag == proto.STATS:
                    pending.discard(msg.source)
                    mailbox.unwatch(msg.source)
        self.store.mark(self.core.drop_leftovers("run_end"), "dropped", self.core.version, "run_end")
        for role in ("reward", "rollout", "trainer"):
            for rank in ranks[role]:
                mailbox.send("run end", rank, proto.STOP)
            for rank in ranks[role]:
                self.handle(mailbox.wait_for(proto.STATS, source=rank))
                mailbox.unwatch(rank)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        acc = self.core.accounting()
        trajectories = {"dispatched": acc["dispatched"], "trained": acc["trained"]}
        trajectories.update({f"dropped ({k})": v for k, v in acc["dropped"].items()})
        trajectories.update({f"failed ({k})": v for k, v in acc["failed"].items()})
        return {
            "success_by_family": {
                f: f"{self.first_success[f]:.2f} -> {self.last_success[f]:.2f}" for f in self.first_success
            },
            "trajectories": trajectories,
            "staleness": acc["staleness"],
            "rollout_versions": {str(rank): versions for rank, versions in self.loaded_history.items()},
            "time_split_s": dict(self.busy),
            "wall_s": time.monotonic() - self.started,
            "balanced": self.core.balanced(),
            "accounting": acc,
        }


def start_workers(config: Config, ctx: RunContext, run_dir: Path, resume: Path | None, version: int) -> Path:
    """START the trainers with the initial model (and the checkpoint to resume from); once they are warm
    (or restored), START everyone else with the trainers' current weights at `version`."""
    from rollart_hpc.controller.model_prep import prepare_model

    mailbox, ranks = ctx.mailbox, ctx.ranks
    model_init = prepare_model(config, run_dir)
    ctx.log.info(f"initial model ready at {model_init}")
    trainer_part = str(resume / "trainer") if resume is not None else None
    for rank in ranks["trainer"]:
        mailbox.send({"model_dir": str(model_init), "resume": trainer_part}, rank, proto.START)
    current = Path(mailbox.wait_for(proto.READY, source=ranks["trainer"][0]).payload["model_dir"])
    for rank in ranks["trainer"][1:]:
        mailbox.wait_for(proto.READY, source=rank)
    ctx.log.info(f"trainers ready at version {version}: {current}")
    others = ranks["rollout"] + ranks["env"] + ranks["reward"]
    for rank in others:
        mailbox.send({"model_dir": str(current), "version": version}, rank, proto.START)
    for rank in others:
        mailbox.wait_for(proto.READY, source=rank)
    return current


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    from rollart_hpc.controller.checkpoint import discard_incomplete, latest
    from rollart_hpc.metrics.run_metrics import summary_table

    tasks = run_tasks(config)
    controller = Controller(config, ctx, tasks)
    for partial in discard_incomplete(run_dir):
        ctx.log.info(f"removed incomplete checkpoint {partial}")
    resume = latest(run_dir)
    if resume is not None:
        controller.resume(resume)
    else:
        controller.start_fresh()
    start_workers(config, ctx, run_dir, resume, controller.core.version)
    ctx.log.info(
        f"RL starts: {len(tasks)} tasks, mode {config.controller.mode}, staleness "
        f"{config.controller.staleness}, {config.controller.num_steps} steps of {config.controller.batch_size}"
    )
    controller.started = time.monotonic()
    stopped = controller.loop()
    summary = controller.shutdown()
    controller.store.close()
    controller.metrics.close()
    if stopped:
        ctx.log.info(f"stop requested: checkpointed at version {controller.core.version}; resume to continue")
        return
    atomic_write_json(run_dir / "summary.json", summary)
    ctx.log.info("\n" + summary_table(summary))
    if not summary["balanced"]:
        raise RuntimeError(f"trajectory accounting is not balanced: {summary['accounting']}")
