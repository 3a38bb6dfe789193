"""Trainer rank of an RL run: warm start, then one SPO++ optimizer step per batch, publishing each version.

Start: form the default torch.distributed group of the trainer ranks (Megatron's data-parallel world),
wait for START (the initial model), warm-start with supervised steps on oracle demonstrations, save the
warm model (first trainer), report READY; the first trainer then builds the weight publisher.
Loop: BATCH (this rank's shard of step n) -> `rl_step` -> the first trainer announces version n+1 to the
rollout ranks (WEIGHTS over MPI), starts the bucketed broadcast in the background (the next step does
not wait for it) and reports TRAINED to the controller. STOP ends the loop after the last publication.
"""

from __future__ import annotations

import datetime as dt
import random
import time
import warnings
from pathlib import Path
from typing import Any

from rollart_hpc.config.schema import Config
from rollart_hpc.contracts import protocol as proto
from rollart_hpc.metrics.timeline import Timeline
from rollart_hpc.rl_common import (
    RunContext,
    agent_config,
    family_specs,
    loss_config,
    run_tasks,
    torch_backend,
)


def init_trainer_group(ctx: RunContext) -> None:
    """The default process group = the trainer ranks, from an MPI rendezvous among them."""
    import torch.distributed as dist

    from rollart_hpc.cluster.world import free_port

    trainers = ctx.ranks["trainer"]
    first = trainers[0]
    if ctx.world.rank == first:
        address = ("127.0.0.1" if len(trainers) == 1 else _host(), free_port())
        for rank in trainers[1:]:
            ctx.world.send(address, rank, tag=proto.START + 100)
    else:
        address = ctx.world.recv(first, tag=proto.START + 100)
    dist.init_process_group(
        torch_backend(ctx.config),
        init_method=f"tcp://{address[0]}:{address[1]}",
        rank=trainers.index(ctx.world.rank),
        world_size=len(trainers),
        timeout=dt.timedelta(seconds=ctx.world.timeout_s),
    )


def _host() -> str:
    import socket

    return socket.gethostbyname(socket.gethostname())


def trainer_config(config: Config, lr: float, timeout_s: float) -> Any:
    from rollart_hpc.train.config import OptimConfig, TrainerConfig

    t = config.trainer
    optim = OptimConfig(lr=lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip)
    return TrainerConfig(
        optim=optim,
        micro_batch_tokens=t.micro_batch_tokens,
        seed=config.run.seed,
        collective_timeout_s=timeout_s,
    )


def set_lr(trainer: Any, lr: float) -> None:
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr


def demonstrations(config: Config, tokenizer: Any) -> list[Any]:
    from rollart_hpc.envs.demos import demonstration_trajectory

    families = {name: spec.build() for name, spec in family_specs(config).items()}
    cfg = agent_config(config)
    return [demonstration_trajectory(families[t.family], t, tokenizer, cfg) for t in run_tasks(config)]


def to_batch(trajs: list[Any]) -> Any:
    from rollart_hpc.train.batch import from_sequences

    return from_sequences(
        [t.token_ids for t in trajs],
        [t.action_mask for t in trajs],
        [t.logprobs for t in trajs],
        [[0.0] * len(t.token_ids) for t in trajs],
        tuple(t.episode_id for t in trajs),
    )


def warm_start(config: Config, ctx: RunContext, trainer: Any, tokenizer: Any) -> dict[str, float]:
    """Supervised steps on oracle demonstrations; each rank takes its share of each sampled batch."""
    t = config.trainer
    demos = demonstrations(config, tokenizer)
    rng = random.Random(config.run.seed)
    trainers = ctx.ranks["trainer"]
    me = trainers.index(ctx.world.rank)
    metrics: dict[str, float] = {}
    for step in range(t.sft_steps):
        picked = [demos[rng.randrange(len(demos))] for _ in range(t.sft_batch_size)]
        total = sum(d.num_action_tokens for d in picked)
        mine = picked[me :: len(trainers)]
        metrics = trainer.sft_step(to_batch(mine), num_global_action_tokens=total)
        if step % 10 == 0 or step == t.sft_steps - 1:
            ctx.log.info(f"warm start {step + 1}/{t.sft_steps}: nll {metrics['loss']:.3f}")
    return metrics


def shard_to_batch(shard: Any) -> Any:
    from rollart_hpc.train.batch import from_sequences

    return from_sequences(
        shard.tokens, shard.action_masks, shard.behaviour_logprobs, shard.advantages, tuple(shard.seq_ids)
    )


def rl_loop(config: Config, ctx: RunContext, trainer: Any, publisher: Any) -> float:
    mailbox, rollouts = ctx.mailbox, ctx.ranks["rollout"]
    cfg = loss_config(config)
    busy_s = 0.0
    timeline = Timeline("trainer", ctx.world.rank)
    while True:
        msg = mailbox.wait_for(frozenset([proto.BATCH, proto.CHECKPOINT, proto.STOP]), source=0)
        if msg.tag == proto.STOP:
            break
        if msg.tag == proto.CHECKPOINT:
            trainer.save_checkpoint(msg.payload)
            mailbox.send(msg.payload, 0, proto.CHECKPOINTED)
            continue
        shard = msg.payload
        start = time.perf_counter()
        span_start = time.time()
        report = trainer.rl_step(shard_to_batch(shard), shard.num_global_action_tokens, cfg)
        if publisher is not None:
            version = shard.step + 1
            publisher.wait()
            for rank in rollouts:
                mailbox.send(version, rank, proto.WEIGHTS)
            publisher.publish(version, trainer.hf_state_dict())
            mailbox.send(
                {**report, "step": shard.step, "train_s": time.perf_counter() - start}, 0, proto.TRAINED
            )
        busy_s += time.perf_counter() - start
        timeline.add(span_start, time.time())
    if publisher is not None:
        publisher.wait()
    timeline.write(ctx.run_dir)
    return busy_s


def main(config: Config, ctx: RunContext, run_dir: Path) -> None:
    # Megatron warns at import that Apex/Transformer Engine are absent (expected without CUDA).
    warnings.filterwarnings(
        "ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*"
    )
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    import torch
    from transformers import AutoTokenizer

    from rollart_hpc.train.trainer import Trainer
    from rollart_hpc.weights.buckets import layout_for
    from rollart_hpc.weights.publisher import WeightPublisher

    torch.set_num_threads(config.trainer.num_threads)
    init_trainer_group(ctx)
    start = ctx.mailbox.wait_for(proto.START, source=0).payload
    model_init = Path(start["model_dir"])
    trainer = Trainer(model_init, trainer_config(config, config.trainer.sft_lr, ctx.world.timeout_s))
    started = time.perf_counter()
    if start["resume"] is None:
        warm_start(config, ctx, trainer, AutoTokenizer.from_pretrained(model_init))
        if config.trainer.rl_fresh_optimizer:
            trainer.reset_optimizer()
        current = run_dir / "model" / "warm"
    else:
        step = trainer.load_checkpoint(start["resume"])
        ctx.log.info(f"restored trainer checkpoint {start['resume']} (optimizer step {step})")
        current = run_dir / "model" / f"resumed-{Path(start['resume']).parent.name}"
    set_lr(trainer, config.trainer.lr)
    first = ctx.world.rank == ctx.ranks["trainer"][0]
    if first:
        trainer.save_hf(current)
    ctx.mailbox.send({"model_dir": str(current), "setup_s": time.perf_counter() - started}, 0, proto.READY)
    publisher = None
    if first:
        bucket_bytes = int(config.trainer.bucket_mb * 2**20)
        publisher = WeightPublisher(
            ctx.weights_group, layout_for(trainer.hf_state_dict().items(), bucket_bytes)
        )
    busy_s = rl_loop(config, ctx, trainer, publisher)
    ctx.mailbox.send({"role": "trainer", "busy_s": busy_s}, 0, proto.STATS)
    ctx.mailbox.flush()
