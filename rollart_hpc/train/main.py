"""Trainer rank of an RL run: warm start, then one SPO++ optimizer step per batch, publishing each version.

Start: the first trainer joins the weights group (with the rollout ranks); form the default
torch.distributed group of the trainer ranks (split by Megatron into TP x PP x DP),
wait for START (the initial model), warm-start with supervised steps on oracle demonstrations, save the
warm model (first trainer), report READY; the first trainer then opens the weight sender
(`rollart_hpc.weights.transport`). Loop: BATCH (this rank's shard of step n) -> `rl_step` -> the first
trainer's sender announces version n+1 to the rollout ranks (WEIGHTS over MPI) and starts the bucketed
broadcast: the sender holds at most two buckets in flight (never a model-sized buffer), so the step
returns once all but the last two buckets are delivered, and those finish in the background (the next
step does not wait for them); it reports TRAINED to the controller. STOP ends the loop after the last
publication.
Weights are published in the training dtype (`trainer.precision`: bf16 halves the bytes); each step's
report (a metrics.jsonl row) carries `weights_bytes`, the tensor bytes of the version it published.
"""

from __future__ import annotations

import datetime as dt
import random
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_hpc.cluster.context import RunContext, torch_backend
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.contracts.records import (
    RankStats,
    Ready,
    StepReport,
    TrainerStart,
    TrainShard,
    Trajectory,
    WeightAnnouncement,
)
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.metrics.timeline import Timeline
from rollart_hpc.tasks.agent_loop import AgentConfig
from rollart_hpc.tasks.build import family_specs, run_tasks
from rollart_hpc.train.config import TrainerConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from rollart_hpc.train.batch import PackedBatch
    from rollart_hpc.train.checkpoint import PendingSave
    from rollart_hpc.train.trainer import Trainer
    from rollart_hpc.weights.publisher import WeightPublisher


def init_trainer_group(ctx: RunContext) -> None:
    """The default process group = the trainer ranks, from a store rendezvous over MPI among them."""
    import torch.distributed as dist

    from rollart_hpc.cluster.torchdist import rendezvous_store

    trainers = ctx.ranks["trainer"]
    timeout = dt.timedelta(seconds=ctx.world.timeout_s)
    store = rendezvous_store(ctx.world, trainers, Tag.TRAINER_RENDEZVOUS, timeout)
    dist.init_process_group(
        torch_backend(ctx.config.cluster, ctx.world.plan, trainers),
        store=store,
        rank=trainers.index(ctx.world.rank),
        world_size=len(trainers),
        timeout=timeout,
    )


def set_lr(trainer: Trainer, lr: float) -> None:
    trainer.set_lr(lr)


def rl_lr(config: Config, step: int) -> float:
    """The learning rate of RL step `step` (0-based): `trainer.lr`, after a linear warmup of
    `trainer.rl_lr_warmup_steps` steps (step k of the warmup: lr x (k + 1) / N)."""
    t = config.trainer
    if t.rl_lr_warmup_steps == 0:
        return t.lr
    return t.lr * min(1.0, (step + 1) / t.rl_lr_warmup_steps)


def demonstrations(config: Config, tokenizer: PreTrainedTokenizerBase) -> list[Trajectory]:
    from rollart_hpc.tasks.demos import demonstration_trajectory

    families = {name: spec.build() for name, spec in family_specs(config.envs).items()}
    cfg = AgentConfig.from_config(config.rollout)
    return [demonstration_trajectory(families[t.family], t, tokenizer, cfg) for t in run_tasks(config.envs)]


def pick_demonstrations(
    demos: list[Trajectory], count: int, sampling: str, rng: random.Random
) -> list[Trajectory]:
    """`count` demonstrations drawn with replacement: each one a task uniformly (`sampling` "task"), or a
    family uniformly and then one of its tasks uniformly ("family"; families in first-seen order, so the
    draws are a function of the seed and the demonstrations' order)."""
    if sampling == "task":
        return [demos[rng.randrange(len(demos))] for _ in range(count)]
    if sampling != "family":
        raise ValueError(f"unknown warm-start sampling {sampling!r} (task or family)")
    by_family: dict[str, list[Trajectory]] = {}
    for demo in demos:
        by_family.setdefault(demo.family, []).append(demo)
    groups = list(by_family.values())
    picked = []
    for _ in range(count):
        group = groups[rng.randrange(len(groups))]
        picked.append(group[rng.randrange(len(group))])
    return picked


def to_batch(trajs: list[Trajectory]) -> PackedBatch:
    from rollart_hpc.train.batch import from_sequences

    return from_sequences(
        [t.token_ids for t in trajs],
        [t.action_mask for t in trajs],
        [t.logprobs for t in trajs],
        [[0.0] * len(t.token_ids) for t in trajs],
        tuple(t.episode_id for t in trajs),
    )


def warm_start(
    config: Config, ctx: RunContext, trainer: Trainer, tokenizer: PreTrainedTokenizerBase
) -> dict[str, float]:
    """Supervised steps on oracle demonstrations; each rank takes its share of each sampled batch."""
    t = config.trainer
    demos = demonstrations(config, tokenizer)
    rng = random.Random(config.run.seed)
    trainers = ctx.ranks["trainer"]
    me = trainers.index(ctx.world.rank)
    metrics: dict[str, float] = {}
    for step in range(t.sft_steps):
        picked = pick_demonstrations(demos, t.sft_batch_size, t.sft_sampling, rng)
        total = sum(d.num_action_tokens for d in picked)
        mine = picked[me :: len(trainers)]
        metrics = trainer.sft_step(to_batch(mine), num_global_action_tokens=total)
        if step % 10 == 0 or step == t.sft_steps - 1:
            ctx.log.info(f"warm start {step + 1}/{t.sft_steps}: nll {metrics['loss']:.3f}")
    return metrics


def shard_to_batch(shard: TrainShard) -> PackedBatch:
    from rollart_hpc.train.batch import from_sequences

    return from_sequences(
        shard.tokens, shard.action_masks, shard.behaviour_logprobs, shard.advantages, tuple(shard.seq_ids)
    )


def publish(trainer: Trainer, sender: WeightPublisher | None, version: int) -> None:
    """Publish the weights as `version` (the sender lives on the first trainer; every rank of the first
    replica calls this). At every layout the weights are converted (and, under tensor or pipeline
    parallelism, gathered) one unit at a time (`Trainer.hf_units`), each unit packed into the send
    buckets as it comes and each bucket on the wire as soon as it is complete: no whole-model copy, and
    the sender holds its bounded ring of send buckets only (`WeightPublisher`)."""
    if sender is not None:
        sender.publish_stream(version, trainer.hf_units())
    else:
        for _ in trainer.hf_units():  # this rank's share of each unit's gather
            pass


def rl_loop(
    config: Config, ctx: RunContext, trainer: Trainer, sender: WeightPublisher | None, weights_bytes: int = 0
) -> float:
    from rollart_hpc.algo.loss import loss_config  # torch

    mailbox = ctx.mailbox
    cfg = loss_config(config.algo)
    busy_s = 0.0
    timeline = Timeline("trainer", ctx.world.rank)
    pending: PendingSave | None = None
    while True:
        msg = mailbox.wait_for(frozenset([Tag.BATCH, Tag.CHECKPOINT, Tag.STOP]), source=0)
        # Every trainer rank gets the same messages in the same order: the collective finish goes here.
        if pending is not None and pending.finish(blocking=msg.tag != Tag.BATCH):
            ctx.log.info(f"checkpoint {pending.final} written: {pending.nbytes} bytes from this rank")
            mailbox.send(str(pending.final), 0, Tag.CHECKPOINTED)
            pending = None
        if msg.tag == Tag.STOP:
            break
        if msg.tag == Tag.CHECKPOINT:
            if config.controller.checkpoint_async:
                gate = config.controller.checkpoint_write_gate
                held = Path(gate) / Path(msg.payload).parent.name if gate else None
                pending = trainer.start_checkpoint(msg.payload, held)  # CHECKPOINTED once every rank wrote it
            else:
                trainer.save_checkpoint(msg.payload)
                mailbox.send(msg.payload, 0, Tag.CHECKPOINTED)
            continue
        shard: TrainShard = msg.payload
        start = time.perf_counter()
        lr = rl_lr(config, shard.step)
        set_lr(trainer, lr)
        span_start = time.time()
        report = trainer.rl_step(shard_to_batch(shard), shard.num_global_action_tokens, cfg) | {"lr": lr}
        publish(trainer, sender, shard.step + 1)
        if sender is not None:
            report["weights_bytes"] = float(weights_bytes)
            step_report = StepReport(shard.step, time.perf_counter() - start, report)
            mailbox.send(step_report, 0, Tag.TRAINED)
        busy_s += time.perf_counter() - start
        timeline.add(span_start, time.time())
    if sender is not None:
        sender.wait()
    timeline.write(ctx.run_dir)
    return busy_s


def published_bytes(specs: dict[str, torch.Tensor]) -> int:
    """The tensor bytes of one published version (the buckets' alignment padding not counted)."""
    return sum(t.numel() * t.element_size() for t in specs.values())


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    # Megatron warns at import that Apex/Transformer Engine are absent (expected without CUDA).
    warnings.filterwarnings(
        "ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*"
    )
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    # Megatron 0.16 still calls the collectives torch 2.13 renamed (`*_single`); the calls work as before.
    warnings.filterwarnings(
        "ignore",
        message=".*(all_gather_into_tensor|reduce_scatter_tensor|_all_gather_base|_reduce_scatter_base)"
        ".* is (deprecated|a private function).*",
        category=FutureWarning,
    )
    # Megatron's distributed optimizer zeroes the grads of its fp32 shard views (non-leaf views of the
    # parameters), which torch warns about; its own source marks the line ("throws grad-access warning").
    warnings.filterwarnings(
        "ignore", message=r".*\.grad attribute of a Tensor that is not a leaf Tensor.*", category=UserWarning
    )
    from rollart_hpc.weights.transport import announce_to, join_run_weight_group, open_publisher  # torch

    group = join_run_weight_group(ctx)  # first of all, as the rollout ranks do (None off the first trainer)
    import torch

    from rollart_hpc.models.tokenizer import load_tokenizer
    from rollart_hpc.train.trainer import HF_MARKER, Trainer

    torch.set_num_threads(config.trainer.num_threads)
    init_trainer_group(ctx)
    start: TrainerStart = ctx.mailbox.wait_for(Tag.START, source=0).payload
    model_init = Path(start.model_dir)
    sft = TrainerConfig.from_config(
        config.trainer,
        lr=config.trainer.sft_lr,
        seed=config.run.seed,
        timeout_s=ctx.world.timeout_s,
        temperature=config.rollout.temperature,
    )
    trainer = Trainer(model_init, sft)
    started = time.perf_counter()
    if start.resume is None:
        warm_start(config, ctx, trainer, load_tokenizer(model_init))
        if config.trainer.rl_fresh_optimizer:
            trainer.reset_optimizer()
        current = RunLayout(run_dir).model / "warm"
    else:
        step = trainer.load_checkpoint(start.resume)
        ctx.log.info(f"restored trainer checkpoint {start.resume} (optimizer step {step})")
        current = RunLayout(run_dir).model / f"resumed-{Path(start.resume).parent.name}"
    set_lr(trainer, config.trainer.lr)
    trainer.save_hf(current)  # all ranks gather; the first trainer writes
    if config.algo.kl_coef:  # the reference policy: the warm start's weights (a resumed run's too)
        warm = run_dir / "model" / "warm"
        trainer.load_reference(warm if (warm / HF_MARKER).exists() else current)
    ctx.mailbox.send(Ready(str(current), time.perf_counter() - started), 0, Tag.READY)
    sender = None
    # The layout of the published tensors (names, shapes, dtypes), gathered unit by unit as they will be.
    specs = {name: t.to("meta") for unit in trainer.hf_units() for name, t in unit.items()}
    weights_bytes = published_bytes(specs)
    if group is not None:
        dtypes = ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in specs.values()}))
        ctx.log.info(f"publishing {len(specs)} tensors, {weights_bytes} bytes per version ({dtypes})")
        announce = announce_to(ctx.mailbox, ctx.ranks["rollout"], Tag.WEIGHTS, WeightAnnouncement)
        sender = open_publisher(
            group, specs, config.trainer.bucket_mb, announce, direct_mb=config.trainer.bucket_direct_mb
        )
    busy_s = rl_loop(config, ctx, trainer, sender, weights_bytes)
    ctx.mailbox.send(RankStats("trainer", busy_s), 0, Tag.STATS)
    ctx.mailbox.flush()
