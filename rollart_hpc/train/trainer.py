"""Data-parallel Megatron-core GPT trainer: SFT warm start, SPO++ RL steps, HF weight export, checkpoints.

Process model: the caller initialises torch.distributed so that the default group holds exactly the
trainer ranks (gloo on CPU, NCCL on GPU); every rank builds a `Trainer` from the same HF directory and
calls the same methods in the same order with its own shard of the step's batch (see
`batch.split_across_ranks`). Each step runs forward/backward over the shard's micro-batches, then one
all_reduce SUM of the flat gradient buffer, clipping, and one AdamW step, so all replicas stay identical.

Invariant: the loss of every micro-batch is divided by the step's *global* action-token count (all ranks
and micro-batches), so summing gradients over micro-batches and ranks gives the gradient of the whole
batch's token-mean loss; gradients are therefore summed, never averaged. Every collective is bounded by
`collective_timeout_s` (comm.py).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rollart_hpc.algo.loss import SUMMED_DIAGNOSTICS, LossConfig, policy_loss
from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.models.config import ModelConfig
from rollart_hpc.train import checkpoint, comm
from rollart_hpc.train.batch import (
    PackedBatch,
    PaddedRows,
    micro_batch_groups,
    select,
    to_padded_rows,
    token_positions,
)
from rollart_hpc.train.config import TrainerConfig
from rollart_hpc.train.convert import megatron_to_hf
from rollart_hpc.train.model import ensure_model_parallel, gpt_from_hf

HF_WEIGHTS = "model.safetensors"
HF_MARKER = "COMPLETE"
RL_METRICS = SUMMED_DIAGNOSTICS  # the policy-loss diagnostics the RL step reports (summed over ranks)
# Per-micro-batch loss: (micro-batch, its per-token log-probs [T] with grad, the positions of its tokens
# in the batch given to the step) -> (loss, metric sums).
LossFn = Callable[[PackedBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class Trainer:
    """One data-parallel replica of an HF Llama/Qwen2 model as a Megatron-core GPTModel with AdamW."""

    def __init__(self, model_dir: str | Path, cfg: TrainerConfig) -> None:
        if not torch.distributed.is_initialized():
            raise RuntimeError("initialise torch.distributed (the trainer ranks) before building a Trainer")
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.device = _pick_device(cfg.compute_dtype)
        ensure_model_parallel(cfg.seed)
        self.model, self.model_config = gpt_from_hf(model_dir, self.device)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._grad = _attach_flat_grad(self.params, self.device)
        self.optimizer = _make_adamw(self.model, cfg)
        self.step = 0

    @property
    def config(self) -> ModelConfig:
        return self.model_config

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The flat gradient of the last step after the all_reduce and clipping (a live view; read only)."""
        return self._grad

    # ---- forward -------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.cfg.compute_dtype == "bfloat16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _token_logprobs(self, micro: PackedBatch) -> torch.Tensor:
        """log p(token t | tokens < t) for every token of `micro` as [T]; 0 at each sequence's first token."""
        rows: PaddedRows = to_padded_rows(micro)
        with self._autocast():
            ce = self.model(rows.input_ids.to(self.device), None, None, labels=rows.targets.to(self.device))
        valid = rows.target_valid.to(self.device)
        index = rows.flat_index.to(self.device)[valid]
        flat = torch.zeros(micro.num_tokens, dtype=torch.float32, device=self.device)
        return flat.index_put((index,), -ce.float()[valid])

    def _check_tokens(self, batch: PackedBatch) -> None:
        vocab = self.model_config.vocab_size
        if batch.num_tokens and not 0 <= int(batch.tokens.min()) <= int(batch.tokens.max()) < vocab:
            lo, hi = int(batch.tokens.min()), int(batch.tokens.max())
            raise ValueError(f"token ids must lie in [0, {vocab}), got {lo}..{hi}")

    def _micro_batches(self, batch: PackedBatch) -> Iterator[tuple[PackedBatch, torch.Tensor]]:
        """Each micro-batch with the positions of its tokens in `batch`."""
        self._check_tokens(batch)
        for group in micro_batch_groups(batch, self.cfg.micro_batch_tokens):
            yield select(batch, group), token_positions(batch, group)

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """Per-token log-probs [T] (CPU, fp32) of the current weights; 0 at each sequence's first token."""
        out = torch.zeros(batch.num_tokens, dtype=torch.float32)
        self._check_tokens(batch)
        for group in micro_batch_groups(batch, self.cfg.micro_batch_tokens):
            out[token_positions(batch, group)] = self._token_logprobs(select(batch, group)).cpu()
        return out

    # ---- steps ---------------------------------------------------------------------------------
    def _global_action_tokens(self, batch: PackedBatch) -> int:
        count = torch.tensor([float(batch.num_action_tokens)], dtype=torch.float64, device=self.device)
        return int(comm.all_reduce_sum(count, "action-token count", self.cfg.collective_timeout_s).item())

    def _run_step(self, batch: PackedBatch, loss_fn: LossFn, names: tuple[str, ...]) -> dict[str, float]:
        """Forward/backward over the micro-batches, sum gradients across ranks, clip, AdamW step.

        `names` lists the metric sums `loss_fn` returns besides the loss; a rank with an empty shard
        (no micro-batch) contributes zeros, so every rank reduces the same tensor."""
        self._grad.zero_()
        sums = {n: torch.zeros((), dtype=torch.float64, device=self.device) for n in ("loss", *names)}
        for micro, positions in self._micro_batches(batch):
            loss, parts = loss_fn(micro, self._token_logprobs(micro), positions)
            loss.backward()
            for name, value in {"loss": loss, **parts}.items():
                sums[name] += value.detach().double()
        metrics = self._reduce_metrics(sums, batch)
        comm.all_reduce_sum(self._grad, "gradient all_reduce", self.cfg.collective_timeout_s)
        metrics["grad_norm"] = self._clip()
        self.optimizer.step()
        self.step += 1
        metrics["step"] = float(self.step)
        return metrics

    def _reduce_metrics(self, sums: dict[str, torch.Tensor], batch: PackedBatch) -> dict[str, float]:
        names = sorted(sums)
        counts = [float(batch.num_tokens), float(batch.num_action_tokens)]
        local = torch.tensor(counts, dtype=torch.float64, device=self.device)
        packed = torch.cat([local, torch.stack([sums[n] for n in names])])
        comm.all_reduce_sum(packed, "metric all_reduce", self.cfg.collective_timeout_s)
        values = packed.tolist()
        return {
            "num_tokens": values[0],
            "num_action_tokens": values[1],
            **dict(zip(names, values[2:], strict=True)),
        }

    def _clip(self) -> float:
        norm = float(torch.linalg.vector_norm(self._grad))
        clip = self.cfg.optim.grad_clip
        if clip > 0 and norm > clip:
            self._grad.mul_(clip / (norm + 1e-6))
        return norm

    def sft_step(self, batch: PackedBatch, num_global_action_tokens: int | None = None) -> dict[str, float]:
        """One AdamW step on the token-mean NLL of the action tokens over all ranks' batches.

        `num_global_action_tokens` defaults to an all_reduce of the local counts. Metrics: loss (global
        mean NLL), grad_norm (before clipping), num_tokens, num_action_tokens, step."""
        if num_global_action_tokens is None:
            num_global_action_tokens = self._global_action_tokens(batch)
        denom = num_global_action_tokens
        _check_denominator(denom, batch)

        def nll(
            micro: PackedBatch, lp: torch.Tensor, _: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            mask = micro.action_mask.to(self.device)
            return -(torch.where(mask, lp, 0.0).sum() / denom), {}

        return self._run_step(batch, nll, ())

    def rl_step(
        self, batch: PackedBatch, num_global_action_tokens: int, loss_cfg: LossConfig
    ) -> dict[str, float]:
        """The PPO updates of one RL step on the SPO++ policy loss (`rollart_hpc.algo.loss.policy_loss`).

        One update (`ppo_epochs` = `num_minibatches` = 1, the default): one AdamW step on the whole
        batch, with the current log-probs, detached, as the proximal ones (the ratio is 1 at its start).
        More: the proximal log-probs are those of the weights at the step's start, computed once before
        the first update; each of `ppo_epochs` epochs walks this rank's sequences in `num_minibatches`
        contiguous minibatches, one AdamW step each, the loss divided by that minibatch's global
        action-token count (one all_reduce of the counts). From the second update on the ratio moves
        away from 1, so the clip, the dual clip and the importance cap act. A minibatch empty on every
        rank is skipped by all. Metrics are means over the updates of the global token means (loss,
        approx_kl, clip_fraction, dual_clip_fraction, is_capped_fraction, is_weight, grad_norm), plus
        num_updates, num_tokens and num_action_tokens of the whole batch, and step."""
        _check_denominator(num_global_action_tokens, batch)
        if self.cfg.ppo_epochs == 1 and self.cfg.num_minibatches == 1:
            return self._policy_update(batch, num_global_action_tokens, loss_cfg, None) | {"num_updates": 1.0}
        proximal = self.logprobs(batch)
        groups = [
            list(map(int, g)) for g in torch.arange(batch.num_sequences).chunk(self.cfg.num_minibatches)
        ]
        groups += [[]] * (self.cfg.num_minibatches - len(groups))  # fewer sequences than minibatches
        local = [float(select(batch, g).num_action_tokens) for g in groups] + [float(batch.num_tokens)]
        counts = torch.tensor(local, dtype=torch.float64, device=self.device)
        *per_group, num_tokens = comm.all_reduce_sum(
            counts, "minibatch token counts", self.cfg.collective_timeout_s
        ).tolist()
        updates = []
        for _ in range(self.cfg.ppo_epochs):
            for group, count in zip(groups, per_group, strict=True):
                if count > 0:
                    mini, old = select(batch, group), proximal[token_positions(batch, group)]
                    updates.append(self._policy_update(mini, int(count), loss_cfg, old))
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
    ) -> dict[str, float]:
        """One AdamW step on the policy loss of `batch`; `proximal` [T] (None: the current, detached)."""

        def spo(
            micro: PackedBatch, lp: torch.Tensor, positions: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            old = None if proximal is None else proximal[positions]
            loss, diagnostics = policy_loss(lp, micro, loss_cfg, num_global_action_tokens, old)
            return loss, diagnostics.summed()

        return self._run_step(batch, spo, RL_METRICS)

    # ---- weights and checkpoints ---------------------------------------------------------------
    def reset_optimizer(self) -> None:
        """Forget the optimizer's moments and step counts: the next step starts a fresh AdamW."""
        self.optimizer.state.clear()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """A snapshot (copies) of the weights under HF names and shapes; no `lm_head.weight` when tied."""
        state = {k: v.detach() for k, v in self.model.state_dict().items() if not k.endswith("._extra_state")}
        return {k: v.clone() for k, v in megatron_to_hf([state], self.model_config).items()}

    def save_hf(self, directory: str | Path) -> Path:
        """Write an HF model directory (safetensors + the source's config and tokenizer files) atomically:
        a temp dir, a rename, then the `COMPLETE` marker. Call it on one rank."""
        from safetensors.torch import save_file

        final = Path(directory).absolute()
        tmp = final.with_name(f".{final.name}.tmp")
        for stale in (tmp, final):
            if stale.exists():
                shutil.rmtree(stale)
        shutil.copytree(self.model_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors*", HF_MARKER))
        weights = {k: v.cpu().contiguous() for k, v in self.hf_state_dict().items()}
        save_file(weights, str(tmp / HF_WEIGHTS), metadata={"format": "pt"})
        tmp.rename(final)
        atomic_write_json(final / HF_MARKER, {"step": self.step})
        return final

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Model, AdamW state and step via Megatron dist_checkpointing (all ranks together; atomic)."""
        return checkpoint.save(
            directory, self.model, self.optimizer, self.step, self.cfg.collective_timeout_s
        )

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore a checkpoint written by `save_checkpoint` (all ranks together); return its step.

        Optimizer hyperparameters come from this trainer's config, not from the checkpoint."""
        self.step = checkpoint.load(directory, self.model, self.optimizer)
        _apply_optim_config(self.optimizer, self.cfg)
        return self.step


def _pick_device(compute_dtype: str) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if compute_dtype != "float32":
        raise ValueError(f"compute_dtype {compute_dtype!r} needs a GPU; the CPU trainer runs in float32")
    return torch.device("cpu")


def _attach_flat_grad(params: list[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """One fp32 buffer holding every parameter's .grad as a view; backward accumulates into it in place."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def _make_adamw(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    o = cfg.optim
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def _apply_optim_config(optimizer: torch.optim.Optimizer, cfg: TrainerConfig) -> None:
    o = cfg.optim
    for i, group in enumerate(optimizer.param_groups):
        group.update(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay if i == 0 else 0.0)


def _check_denominator(num_global_action_tokens: int, batch: PackedBatch) -> None:
    if num_global_action_tokens < max(batch.num_action_tokens, 1):
        raise ValueError(
            f"num_global_action_tokens {num_global_action_tokens} is below this rank's "
            f"{batch.num_action_tokens} action tokens (or 0)"
        )
