"""Megatron-core GPT trainer over a (TP, PP, DP) layout: SFT warm start, SPO++ RL steps, HF export, checkpoints.

Process model: the caller initialises torch.distributed so that the default group holds exactly the
trainer ranks (gloo on CPU, NCCL on GPU); every rank builds a `Trainer` from the same HF directory and
calls the same methods in the same order with its own share of the step's batch (see
`batch.split_across_ranks`). Megatron's parallel state splits the ranks into tensor-parallel groups,
pipeline stages and data-parallel replicas (`model.ensure_model_parallel`); the ranks of one
model-parallel group (TP x PP) pool their shares, so each data-parallel replica trains on the union of
its ranks' sequences. A step runs Megatron's schedule (`get_forward_backward_func`: no pipelining at
PP = 1, 1F1B otherwise) over the replica's packed micro-batches, Megatron DDP reduces gradients in
buckets, and Megatron's optimizer clips by the global norm and steps (Adam states sharded over DP with
the distributed optimizer), so all replicas stay identical.

Invariant: the loss of every micro-batch is divided by the step's *global* action-token count (all
ranks and micro-batches), or weighed per trajectory over the global trajectory count (`algo.loss_agg`),
computed on the last pipeline stage, and gradients are summed over
micro-batches and data-parallel replicas (never averaged), so the step follows the gradient of the
whole batch's token-mean loss whatever the layout. Metrics are reduced once per step from the last
stage's first tensor-parallel rank of every replica. Every collective is bounded by
`collective_timeout_s` (comm.py and the timeout of Megatron's groups).
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from rollart_hpc.algo.loss import LossConfig, policy_loss
from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.kernels.token_loss import SUMMED_DIAGNOSTICS, action_tokens_per_sequence
from rollart_hpc.models.checkpoint import ShardWriter
from rollart_hpc.models.config import ModelConfig
from rollart_hpc.train import checkpoint, comm, parallel
from rollart_hpc.train.batch import (
    PackedBatch,
    PaddedRows,
    concat,
    from_sequences,
    micro_batch_groups,
    select,
    to_padded_rows,
    token_positions,
)
from rollart_hpc.train.config import TrainerConfig
from rollart_hpc.train.convert import from_stage, stage_layers, unit_entries, unit_to_hf
from rollart_hpc.train.convert import hf_units as convert_units
from rollart_hpc.train.gather import gather_hf_units
from rollart_hpc.train.lm_head import LMHead, token_entropy, token_logprobs_entropy
from rollart_hpc.train.model import Layout, ensure_model_parallel, gpt_from_hf

HF_SHARD_BYTES = 2 << 30  # the largest safetensors file `save_hf` writes
HF_MARKER = "COMPLETE"
RL_METRICS = SUMMED_DIAGNOSTICS  # the policy-loss diagnostics the RL step reports (summed over replicas)
# The RL step's largest |log pi_old - log pi_behaviour| over action tokens (reduced by max, not summed):
# 0 up to rounding when the trainer's log-probs are those of the distribution the engine sampled from.
BEHAVIOUR_GAP = "max_abs_behaviour_log_ratio"
# Per-micro-batch loss: (micro-batch, its per-token log-probs [T] with grad, the positions of its tokens
# in the batch given to the step) -> (loss, metric sums).
# With `_entropy_mode` set, the policy's per-token entropy [T] follows (else None).
LossFn = Callable[
    [PackedBatch, torch.Tensor, torch.Tensor, torch.Tensor | None],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]


class Micro(NamedTuple):
    """One micro-batch of a replica's batch: its sequences, their token positions, its padded rows."""

    batch: PackedBatch
    positions: torch.Tensor
    rows: PaddedRows
    dummy: bool = False  # stands in for an empty batch: loss 0, every gradient 0


class Trainer:
    """This rank's shard of an HF Llama/Qwen2 model as a Megatron-core GPTModel, with Megatron DDP and Adam."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig) -> None:
        if not torch.distributed.is_initialized():
            raise RuntimeError("initialise torch.distributed (the trainer ranks) before building a Trainer")
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.device = pick_device()
        self.layout: Layout = ensure_model_parallel(
            cfg.seed, cfg.tensor_parallel, cfg.pipeline_parallel, cfg.collective_timeout_s
        )
        self.gpt, self.model_config = gpt_from_hf(
            model_dir,
            self.device,
            self.layout,
            cfg.sequence_parallel,
            cfg.precision,
            cfg.attention,
            cfg.recompute,
        )
        self.gpt.return_hidden = True  # the head runs in `lm_head.token_logprobs` (fused or eager)
        # Sequence-parallel hidden states come from a gather whose backward already sums over the TP group.
        self._head = LMHead(
            self.model_config.vocab_size,
            self.layout.tp_size,
            cfg.collective_timeout_s,
            copy_to_tp=not cfg.sequence_parallel,
        )
        self.model, self.optimizer = parallel.wrap(self.gpt, cfg)
        self.model.train()
        self.step = 0
        self._sums: dict[str, torch.Tensor] = {}
        self._temperature = cfg.temperature
        self._entropy_mode: str | None = None  # None | "detached" | "grad": the RL loss's entropy
        self._reference: Any = None  # the frozen reference policy (`load_reference`), or None

    @property
    def config(self) -> ModelConfig:
        return self.model_config

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """This shard's trainable parameters, in model order."""
        return [p for p in self.gpt.parameters() if p.requires_grad]

    @property
    def grad_buffer(self) -> torch.Tensor:
        """This shard's gradient of the last step, flat in parameter order, after the DP reduction and
        clipping (a copy; with the distributed optimizer only this rank's DP slice is reduced)."""
        grads = [p.main_grad.reshape(-1) for p in self.params]  # type: ignore[attr-defined]
        return torch.cat(grads).clone()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the following steps."""
        parallel.set_hyperparameters(self.optimizer, self.cfg, lr)

    # ---- batches -------------------------------------------------------------------------------
    def _check_tokens(self, batch: PackedBatch) -> None:
        vocab = self.model_config.vocab_size
        if batch.num_tokens and not 0 <= int(batch.tokens.min()) <= int(batch.tokens.max()) < vocab:
            lo, hi = int(batch.tokens.min()), int(batch.tokens.max())
            raise ValueError(f"token ids must lie in [0, {vocab}), got {lo}..{hi}")

    def _pool(self, batch: PackedBatch) -> tuple[PackedBatch, int]:
        """(the union of the shares of this rank's model-parallel group, this rank's token offset in it)."""
        from megatron.core import parallel_state

        self._check_tokens(batch)
        if self.layout.tp_size * self.layout.pp_size == 1:
            return batch, 0
        group = parallel_state.get_model_parallel_group()
        shares: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(shares, batch, group=group)
        me = dist.get_rank(group)
        return concat(shares), sum(s.num_tokens for s in shares[:me])

    def _micros(self, batch: PackedBatch) -> list[Micro]:
        """The micro-batches of a replica's batch; an empty batch runs one masked-out dummy micro-batch,
        so every replica takes part in the gradient reduction."""
        groups = micro_batch_groups(batch, self.cfg.micro_batch_tokens)
        multiple = self.layout.tp_size if self.cfg.sequence_parallel else 1
        if not groups:
            dummy = _dummy_batch()
            return [Micro(dummy, torch.arange(dummy.num_tokens), to_padded_rows(dummy, multiple), dummy=True)]
        return [
            Micro(select(batch, g), token_positions(batch, g), to_padded_rows(select(batch, g), multiple))
            for g in groups
        ]

    # ---- forward / backward through Megatron's schedule ----------------------------------------
    def _head_weight(self) -> torch.Tensor:
        if self.model_config.tie_word_embeddings:
            weight: torch.Tensor = self.gpt.shared_embedding_or_output_weight()
            return weight
        out: torch.Tensor = self.gpt.output_layer.weight
        return out

    def _packed_hidden(self, micro: Micro, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last hidden states of the micro-batch's predicted tokens, packed [N, H]; their mask over
        the padded rows)."""
        valid = micro.rows.target_valid.to(self.device)
        if self.cfg.sequence_parallel:  # [s/TP, b, H] -> [s, b, H]; its backward sums over TP
            from megatron.core import tensor_parallel

            output = tensor_parallel.gather_from_sequence_parallel_region(
                output, tensor_parallel_output_grad=True
            )
        hidden = output.transpose(0, 1)[valid]  # packed [N, H]: no padding reaches the head
        if self._temperature != 1.0:  # log softmax(W h / T) = log softmax(W (h / T)): the head has no bias
            hidden = hidden / self._temperature
        return hidden, valid

    def _token_entropy(self, micro: Micro, output: torch.Tensor) -> torch.Tensor:
        """The policy's entropy [T] at the micro-batch's action tokens (0 elsewhere; the loss reads no
        other), with its gradient in `_entropy_mode` "grad" (`lm_head.token_entropy`)."""
        hidden, valid = self._packed_hidden(micro, output)
        index = micro.rows.flat_index.to(self.device)[valid]
        action = micro.batch.action_mask.to(self.device)[index]
        with contextlib.nullcontext() if self._entropy_mode == "grad" else torch.no_grad():
            ent = token_entropy(self._head, hidden[action], self._head_weight())
        flat = torch.zeros(micro.batch.num_tokens, dtype=torch.float32, device=self.device)
        return flat.index_put((index[action],), ent)

    def _token_logprobs(
        self, micro: Micro, output: torch.Tensor, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(token t | tokens < t) for every token of the micro-batch as [T] (0 at each sequence's
        first token), from the last stage's final hidden states through `lm_head.token_logprobs_entropy`;
        `with_entropy` (and loss_impl "fused"): also the detached entropy [T] at the action tokens (0
        elsewhere) from the same pass, else None."""
        rows = micro.rows
        hidden, valid = self._packed_hidden(micro, output)
        targets = rows.targets.to(self.device)[valid]
        lp, ent = token_logprobs_entropy(
            self.cfg.loss_impl, self._head, hidden, self._head_weight(), targets, with_entropy
        )
        index = rows.flat_index.to(self.device)[valid]
        flat = torch.zeros(micro.batch.num_tokens, dtype=torch.float32, device=self.device)
        if ent is None:
            return flat.index_put((index,), lp.float()), None
        action = micro.batch.action_mask.to(self.device)[index]
        entropy = flat.index_put((index[action],), ent[action].float())
        return flat.index_put((index,), lp.float()), entropy

    def _loss(self, micro: Micro, loss_fn: LossFn, output: torch.Tensor) -> tuple[Any, ...]:
        # Entropy only logged (entropy_coef 0): taken from the log-prob pass, no second pass over the head.
        lp, entropy = self._token_logprobs(micro, output, self._entropy_mode == "detached")
        if micro.dummy:  # the whole graph, so that every parameter receives its (zero) gradient
            return lp.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}
        if self._entropy_mode and entropy is None:  # an entropy term (its gradient), or loss_impl "eager"
            entropy = self._token_entropy(micro, output)
        loss, parts = loss_fn(micro.batch, lp, micro.positions, entropy)
        for name, value in {"loss": loss, **parts}.items():
            if name == BEHAVIOUR_GAP and name in self._sums:
                self._sums[name] = torch.maximum(self._sums[name], value.detach().double())
            elif name in self._sums:
                self._sums[name] += value.detach().double()
        # The loss is already divided by the global action-token count: a count of 0 tells Megatron's
        # per-token mode not to divide again.
        return loss, torch.tensor(0, dtype=torch.int), {}

    def _forward_step(self, loss_fn: LossFn) -> Callable[[Any, Any], tuple[torch.Tensor, Any]]:
        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            micro: Micro = next(data_iterator)
            ids = micro.rows.input_ids.to(self.device)
            # The last stage returns its final hidden states, in the parameter dtype: under bf16 the
            # head takes bf16 hidden states and weights and accumulates in fp32 (`lm_head`).
            extra = {"fp32_output": False} if self.cfg.precision == "bf16" else {}
            output = model(ids, None, None, **extra)
            return output, functools.partial(self._loss, micro, loss_fn)

        return forward_step

    def _forward_backward(self, micros: list[Micro], loss_fn: LossFn, forward_only: bool) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        get_forward_backward_func()(
            forward_step_func=self._forward_step(loss_fn),
            data_iterator=iter(micros),
            model=[self.model],
            num_microbatches=len(micros),
            seq_length=max(m.rows.input_ids.shape[1] for m in micros),
            micro_batch_size=max(m.rows.input_ids.shape[0] for m in micros),
            forward_only=forward_only,
        )

    def _pooled_logprobs(self, pooled: PackedBatch) -> torch.Tensor:
        """Per-token log-probs [T] (CPU, fp32) of a replica's batch on every rank of its group."""
        from megatron.core import parallel_state

        out = torch.zeros(pooled.num_tokens, dtype=torch.float32)

        def record(
            micro: PackedBatch, lp: torch.Tensor, positions: torch.Tensor, _: torch.Tensor | None
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            out[positions] = lp.detach().cpu()
            return lp.sum() * 0.0, {}

        self._sums = {}
        with torch.no_grad():
            self._forward_backward(self._micros(pooled), record, forward_only=True)
        if self.layout.pp_size > 1:
            last = parallel_state.get_pipeline_model_parallel_last_rank()
            group = parallel_state.get_pipeline_model_parallel_group()
            comm.broadcast(out, last, "pipeline log-probs", self.cfg.collective_timeout_s, group)
        return out

    def load_reference(self, model_dir: str | Path) -> None:
        """Hold the HF weights of `model_dir` as the frozen reference policy: a second shard of this rank's
        (TP, PP) layout, without gradients or optimizer state (all ranks together)."""
        reference, _ = gpt_from_hf(model_dir, self.device, self.layout, self.cfg.sequence_parallel)
        reference.return_hidden = True
        reference.requires_grad_(False)
        reference.eval()
        self._reference = reference

    @contextlib.contextmanager
    def _as_reference(self) -> Iterator[None]:
        saved = self.gpt, self.model
        self.gpt = self.model = self._reference
        try:
            yield
        finally:
            self.gpt, self.model = saved

    def _reference_logprobs(self, pooled: PackedBatch) -> torch.Tensor:
        """The reference policy's per-token log-probs [T] (CPU, fp32) of a replica's batch, through the same
        forward-only schedule as `logprobs`."""
        if self._reference is None:
            raise RuntimeError("a KL to the reference policy needs Trainer.load_reference first")
        with self._as_reference():
            return self._pooled_logprobs(pooled)

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """Per-token log-probs [T] (CPU, fp32) of the current weights for this rank's `batch` (all ranks
        together) at the RL temperature (`TrainerConfig.temperature`); 0 at each sequence's first token."""
        pooled, offset = self._pool(batch)
        return self._pooled_logprobs(pooled)[offset : offset + batch.num_tokens].clone()

    # ---- steps ---------------------------------------------------------------------------------
    def _global_action_tokens(self, batch: PackedBatch) -> int:
        count = torch.tensor([float(batch.num_action_tokens)], dtype=torch.float64, device=self.device)
        return int(comm.all_reduce_sum(count, "action-token count", self.cfg.collective_timeout_s).item())

    def _global_action_sequences(self, pooled: PackedBatch) -> int:
        """The trajectories with an action token of all replicas' pooled batches."""
        count = torch.tensor([float(_action_sequences(pooled))], dtype=torch.float64, device=self.device)
        timeout = self.cfg.collective_timeout_s
        return int(comm.all_reduce_sum(count, "sequence count", timeout, self._dp_group()).item())

    def _dp_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def _records_metrics(self) -> bool:
        return self.layout.last_stage and self.layout.tp_rank == 0

    def _run_step(self, pooled: PackedBatch, loss_fn: LossFn, names: tuple[str, ...]) -> dict[str, float]:
        """Megatron's forward/backward over the replica's micro-batches, DDP reduction, clip, Adam step.

        `names` lists the metric sums `loss_fn` returns besides the loss."""
        self._sums = {n: torch.zeros((), dtype=torch.float64, device=self.device) for n in ("loss", *names)}
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._forward_backward(self._micros(pooled), loss_fn, forward_only=False)
        metrics = self._reduce_metrics(self._sums, pooled)
        metrics["grad_norm"] = parallel.step(self.optimizer)
        self.step += 1
        metrics["step"] = float(self.step)
        return metrics

    def _reduce_metrics(self, sums: dict[str, torch.Tensor], batch: PackedBatch) -> dict[str, float]:
        gap = sums.pop(BEHAVIOUR_GAP, None)
        names = sorted(sums)
        counts = [float(batch.num_tokens), float(batch.num_action_tokens)]
        local = torch.tensor(counts, dtype=torch.float64, device=self.device)
        packed = torch.cat([local, torch.stack([sums[n] for n in names])])
        if not self._records_metrics():
            packed.zero_()
        comm.all_reduce_sum(packed, "metric all_reduce", self.cfg.collective_timeout_s)
        values = packed.tolist()
        metrics = {
            "num_tokens": values[0],
            "num_action_tokens": values[1],
            **dict(zip(names, values[2:], strict=True)),
        }
        if gap is not None:
            gap = gap.reshape(1) if self._records_metrics() else torch.zeros_like(gap).reshape(1)
            comm.all_reduce(gap, "metric max", self.cfg.collective_timeout_s, dist.ReduceOp.MAX)
            metrics[BEHAVIOUR_GAP] = float(gap.item())
        return metrics

    def sft_step(self, batch: PackedBatch, num_global_action_tokens: int | None = None) -> dict[str, float]:
        """One optimizer step on the token-mean NLL of the action tokens over all ranks' batches, at
        temperature 1 (demonstrations are not samples of the policy).

        `num_global_action_tokens` defaults to an all_reduce of the local counts. Metrics: loss (global
        mean NLL), grad_norm (before clipping), num_tokens, num_action_tokens, step."""
        if num_global_action_tokens is None:
            num_global_action_tokens = self._global_action_tokens(batch)
        pooled, _ = self._pool(batch)
        denom = num_global_action_tokens
        _check_denominator(denom, pooled)

        def nll(
            micro: PackedBatch, lp: torch.Tensor, _: torch.Tensor, __: torch.Tensor | None
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            mask = micro.action_mask.to(self.device)
            return -(torch.where(mask, lp, 0.0).sum() / denom), {}

        self._temperature = 1.0
        try:
            return self._run_step(pooled, nll, ())
        finally:
            self._temperature = self.cfg.temperature

    def rl_step(
        self, batch: PackedBatch, num_global_action_tokens: int, loss_cfg: LossConfig
    ) -> dict[str, float]:
        """The PPO updates of one RL step on the SPO++ policy loss (`rollart_hpc.algo.loss.policy_loss`).

        One update (`ppo_epochs` = `num_minibatches` = 1, the default): one optimizer step on the whole
        batch, with the current log-probs, detached, as the proximal ones (the ratio is 1 at its start).
        More: the proximal log-probs are those of the weights at the step's start, computed once before
        the first update; each of `ppo_epochs` epochs walks the replica's sequences in `num_minibatches`
        contiguous minibatches, one optimizer step each, the loss divided by that minibatch's global
        action-token count (one all_reduce of the counts over the replicas). From the second update on
        the ratio moves away from 1, so the clip, the dual clip and the importance cap act. A minibatch
        empty on every replica is skipped by all. Metrics are means over the updates of the global token
        means (loss, approx_kl, clip_fraction, dual_clip_fraction, is_capped_fraction, is_rejected_fraction,
        is_weight, entropy (mean over action tokens), grad_norm), plus num_updates, num_tokens and
        num_action_tokens of the whole batch, step, and max_abs_behaviour_log_ratio (the largest |proximal -
        behaviour| log-prob of an action token). Every log-prob is log softmax(logits /
        `TrainerConfig.temperature`), the distribution the rollout engines sampled from."""
        pooled, _ = self._pool(batch)
        _check_denominator(num_global_action_tokens, pooled)
        reference = self._reference_logprobs(pooled) if loss_cfg.kl_coef else None
        if self.cfg.ppo_epochs == 1 and self.cfg.num_minibatches == 1:
            seqs = self._global_action_sequences(pooled) if loss_cfg.loss_agg != "token_mean" else None
            update = self._policy_update(pooled, num_global_action_tokens, loss_cfg, None, seqs, reference)
            return update | {"num_updates": 1.0}
        proximal = self._pooled_logprobs(pooled)
        groups = [
            list(map(int, g)) for g in torch.arange(pooled.num_sequences).chunk(self.cfg.num_minibatches)
        ]
        groups += [[]] * (self.cfg.num_minibatches - len(groups))  # fewer sequences than minibatches
        local = [float(select(pooled, g).num_action_tokens) for g in groups] + [float(pooled.num_tokens)]
        local += [float(_action_sequences(select(pooled, g))) for g in groups]
        counts = torch.tensor(local, dtype=torch.float64, device=self.device)
        reduced = comm.all_reduce_sum(
            counts, "minibatch token counts", self.cfg.collective_timeout_s, self._dp_group()
        ).tolist()
        per_group, num_tokens, seqs_per_group = (
            reduced[: len(groups)],
            reduced[len(groups)],
            reduced[-len(groups) :],
        )
        updates = []
        for _ in range(self.cfg.ppo_epochs):
            for group, count, seqs in zip(groups, per_group, seqs_per_group, strict=True):
                if count > 0:
                    positions = token_positions(pooled, group)
                    mini, old = select(pooled, group), proximal[positions]
                    ref = None if reference is None else reference[positions]
                    updates.append(self._policy_update(mini, int(count), loss_cfg, old, int(seqs), ref))
        metrics = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
        metrics.update(
            num_tokens=num_tokens,
            num_action_tokens=float(sum(per_group)),
            num_updates=float(len(updates)),
            step=float(self.step),
        )
        return metrics

    def _policy_update(
        self,
        batch: PackedBatch,
        num_global_action_tokens: int,
        loss_cfg: LossConfig,
        proximal: torch.Tensor | None,
        num_global_sequences: int | None = None,
        reference: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step on the policy loss of a replica's `batch`; `proximal` [T] (None: the
        current log-probs, detached); `num_global_sequences`: the step's trajectories with an action
        token over all replicas (the denominator of the per-trajectory aggregations); `reference` [T]: the
        reference policy's log-probs (the KL term; its token mean is reported as kl)."""

        def spo(
            micro: PackedBatch, lp: torch.Tensor, positions: torch.Tensor, entropy: torch.Tensor | None
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            old = None if proximal is None else proximal[positions]
            ref = None if reference is None else reference[positions]
            loss, diagnostics = policy_loss(
                lp, micro, loss_cfg, num_global_action_tokens, old, num_global_sequences, entropy, ref
            )
            assert diagnostics.entropy is not None
            parts = {
                **diagnostics.summed(),
                "entropy": diagnostics.entropy,
                BEHAVIOUR_GAP: _behaviour_gap(micro, lp, old),
            }
            return loss, parts if diagnostics.kl is None else {**parts, "kl": diagnostics.kl}

        self._entropy_mode = "grad" if loss_cfg.entropy_coef else "detached"
        try:
            names = (*RL_METRICS, "entropy", BEHAVIOUR_GAP, *(("kl",) if reference is not None else ()))
            return self._run_step(batch, spo, names)
        finally:
            self._entropy_mode = None

    # ---- weights and checkpoints ---------------------------------------------------------------
    def reset_optimizer(self) -> None:
        """Forget the optimizer's moments and step counts: the next step starts a fresh Adam."""
        parallel.reset_states(self.optimizer)

    def _stage_state(self) -> dict[str, torch.Tensor]:
        """This rank's shard under Megatron names with global layer numbers (a tied head's copy dropped)."""
        local = {k: v.detach() for k, v in self.gpt.state_dict().items() if not k.endswith("._extra_state")}
        lay = self.layout
        layers = stage_layers(self.model_config.num_layers, lay.pp_rank, lay.pp_size)
        return from_stage(local, layers, lay.first_stage, self.model_config.tie_word_embeddings)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """A snapshot of the weights under HF names and shapes (no `lm_head.weight` when tied), the union
        of `hf_units()` (the tensors that share storage with the model copied): the whole model on
        trainer rank 0, {} on every other rank. All ranks call it together. A whole-model copy, for
        inspection and tests: publication and `save_hf` stream `hf_units()` instead."""
        live = {p.untyped_storage().data_ptr() for p in self.gpt.parameters()}
        return {
            name: t.clone() if t.untyped_storage().data_ptr() in live else t
            for unit in self.hf_units()
            for name, t in unit.items()
        }

    def hf_units(self) -> Iterator[dict[str, torch.Tensor]]:
        """The HF weights unit by unit (`convert.hf_units`: the embedding, the final norm and head, each
        layer), converted one unit at a time and, under tensor or pipeline parallelism, gathered as
        tensors on trainer rank 0 from the ranks of the first replica that hold it (`gather`), so no
        rank ever holds more than its own shard plus one unit; rank 0 yields the unit's HF tensors, the
        other ranks of the replica empty dicts. All ranks of the first replica iterate it together;
        other replicas get nothing. A unit's tensors may share storage with the model (norms): they
        are valid until the next optimizer step."""
        from megatron.core import parallel_state

        cfg, lay = self.model_config, self.layout
        if lay.dp_rank != 0:
            return
        state = self._stage_state()
        if lay.tp_size * lay.pp_size == 1:
            for unit in convert_units(cfg.num_layers, 1):
                yield unit_to_hf([unit_entries(state, unit)], cfg, unit)
            return
        tp_group = parallel_state.get_tensor_model_parallel_group()
        pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        yield from gather_hf_units(state, cfg, lay, tp_group, pp_ranks)

    def save_hf(self, directory: str | Path, shard_bytes: int = HF_SHARD_BYTES) -> Path:
        """Write an HF model directory (safetensors + the source's config and tokenizer files) atomically:
        a temp dir, a rename, then the `COMPLETE` marker. All ranks call it; trainer rank 0 writes the
        units as they are gathered (`hf_units`) into files of at most `shard_bytes` (`ShardWriter`: one
        `model.safetensors`, or shards with `model.safetensors.index.json`), so it holds one file's
        tensors at most, never the whole model."""
        final = Path(directory).absolute()
        writer = None
        if comm.rank() == 0:
            tmp = final.with_name(f".{final.name}.tmp")
            for stale in (tmp, final):
                if stale.exists():
                    shutil.rmtree(stale)
            shutil.copytree(self.model_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors*", HF_MARKER))
            writer = ShardWriter(tmp, shard_bytes)
        for unit in self.hf_units():
            if writer is not None:
                writer.add(unit)
        if writer is None:
            return final
        writer.close()
        writer.folder.rename(final)
        atomic_write_json(final / HF_MARKER, {"step": self.step})
        return final

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Model shards, optimizer state and step via Megatron dist_checkpointing (all ranks; atomic)."""
        return checkpoint.save(directory, self.gpt, self.optimizer, self.step, self.cfg.collective_timeout_s)

    def start_checkpoint(self, directory: str | Path, gate: Path | None = None) -> checkpoint.PendingSave:
        """`save_checkpoint` in the background: returns once the shards are copied to host memory; the
        checkpoint is complete when `PendingSave.finish` (all ranks) returns True."""
        return checkpoint.start_save(
            directory, self.gpt, self.optimizer, self.step, self.cfg.collective_timeout_s, gate
        )

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore a checkpoint written by `save_checkpoint` at any (TP, PP, DP) layout (all ranks
        together); return its step. Optimizer hyperparameters come from this trainer's config."""
        self.step = checkpoint.load(directory, self.gpt, self.optimizer)
        parallel.set_hyperparameters(self.optimizer, self.cfg)
        return self.step


def _behaviour_gap(micro: PackedBatch, lp: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    """max |old - behaviour| log-prob over the micro-batch's action tokens (old: the proximal log-probs,
    None = the current ones), 0 without action tokens."""
    mask = micro.action_mask.to(lp.device)
    old_lp = lp.detach() if old is None else old.to(lp.device)
    gap = (old_lp - micro.behaviour_logprobs.to(lp.device)).abs()
    return torch.where(mask, gap, 0.0).max() if gap.numel() else gap.sum()


def _dummy_batch() -> PackedBatch:
    """One two-token sequence with no action token: a micro-batch whose loss and gradients are 0."""
    return from_sequences([[0, 0]], [[0, 0]], [[0.0, 0.0]], [[0.0, 0.0]])


def pick_device() -> torch.device:
    """The trainer's device on this rank: the current CUDA device, which the rank's placement chose
    (`cluster.placement.apply_placement`), with TF32 on for fp32 matmuls and convolutions; or the CPU
    without CUDA. Single-rank tests build their models and inputs on it (tests/train_device.py)."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _action_sequences(batch: PackedBatch) -> int:
    """The sequences of `batch` with at least one action token."""
    return int((action_tokens_per_sequence(batch.action_mask, batch.cu_seqlens) > 0).sum())


def _check_denominator(num_global_action_tokens: int, batch: PackedBatch) -> None:
    if num_global_action_tokens < max(batch.num_action_tokens, 1):
        raise ValueError(
            f"num_global_action_tokens {num_global_action_tokens} is below this rank's "
            f"{batch.num_action_tokens} action tokens (or 0)"
        )
