"""SPO++ policy loss: the algorithm's config and `policy_loss`, the one entry point the trainer calls.

    policy_loss(source, batch, cfg, num_global_action_tokens, old_logprobs=None) -> (loss, LossDiagnostics)

The per-token math (`ppo_token_terms`, formulas in `rollart_hpc.kernels.token_loss`) and the reduction
(per-token weights by `loss_agg`: 1 / the global action-token count of the optimizer step across
micro-batches and DP ranks, or per-trajectory weights over the global trajectory count, see
`aggregation_weights`; diagnostics) exist once, in the kernels' torch reference; `LossConfig` is the kernels' `KernelLossConfig`
(built from the [algo] section by `loss_config`); this module picks the implementation by the type of `source`:

- token log-probs [T] with gradient: the torch reference (the trainer's path: its model computes the
  log-probs, then `ppo_token_terms` runs in torch);
- `LMHeadInputs` (final hidden states [T, H], LM-head weight [V, H], targets [T]): the fused kernel
  `rollart_hpc.kernels.fused_token_terms`, which never materialises the [T, V] logits. The trainer
  takes the first path with `trainer.loss_impl = "fused"` too: `rollart_hpc.train.lm_head` computes its
  token log-probs from the hidden states and the (vocabulary-parallel) LM-head shard a chunk at a time,
  so it never builds [T, V] logits either; this second path (the whole loss fused with the LM head)
  stays for callers that hold an unsharded LM head, and is pinned equal to the first by the tests.

Both feed the same `reduce_token_terms`, so loss and diagnostics mean the same on either path.
Invariant: summing the outputs of any split of a batch (micro-batches, ranks) gives the loss and
gradients of the whole batch; DP gradients must therefore be summed across ranks (or the loss scaled by
the DP size when the wrapper averages). Diagnostics sum to global means; max |A| reduces by max.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rollart_hpc.algo import LOSS_EXPORTS
from rollart_hpc.config.derive import derive
from rollart_hpc.config.learning import AlgoConfig
from rollart_hpc.kernels.common import KernelLossConfig, KernelTuning, LossInputs
from rollart_hpc.kernels.entropy import head_entropy
from rollart_hpc.kernels.policy_loss import fused_token_terms, linear_logprob
from rollart_hpc.kernels.token_loss import SUMMED_DIAGNOSTICS as SUMMED_DIAGNOSTICS
from rollart_hpc.kernels.token_loss import (
    LossDiagnostics,
    TokenTerms,
    aggregation_weights,
    kl_estimate,
    ppo_token_terms,
    reduce_token_terms,
    reward_to_go,
)

__all__ = list(LOSS_EXPORTS)


LossConfig = KernelLossConfig
"""The loss's parameters: the kernels' own type (asymmetric clip 0.2 / 0.28 as in DAPO, dual clip and
behaviour-weight cap 2 as in SPO++, log-ratio clamp 20 as in verl, and the switches below); a run builds
it from its [algo] section with `loss_config`."""


def _off_if_zero(value: float) -> float | None:
    return value or None


LOSS_FROM_ALGO = derive(
    LossConfig,
    AlgoConfig,
    kept=("log_ratio_clamp",),
    convert={
        **dict.fromkeys(("dual_clip_c", "is_cap", "is_reject_low", "is_reject_high"), _off_if_zero),
        "kl_estimator": lambda value: value or LossConfig.kl_estimator,
        "kl_in": lambda value: value or LossConfig.kl_in,
    },
)
"""The run's loss from the resolved [algo] section, field by field (0 turns dual_clip_c, is_cap and the
rejection bounds off; an unset KL estimator or placement is the loss's default)."""


def loss_config(algo: AlgoConfig) -> LossConfig:
    """The run's loss from the resolved `algo` section (`LOSS_FROM_ALGO`)."""
    return LOSS_FROM_ALGO(algo)


class LossBatch(Protocol):
    """The per-token constants of the loss, each [T] (`rollart_hpc.train.batch.PackedBatch` is one).

    `advantages` are per token (0 off the action tokens); `action_mask` is 1 on action tokens."""

    @property
    def action_mask(self) -> torch.Tensor: ...

    @property
    def behaviour_logprobs(self) -> torch.Tensor: ...

    @property
    def advantages(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class SequenceBatch:
    """A `LossBatch` with the trajectories' boundaries `cu_seqlens` [B + 1] (per-token fields [T])."""

    action_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    cu_seqlens: torch.Tensor


@dataclass(frozen=True)
class LMHeadInputs:
    """The fused path's source: final hidden states [T, H], LM-head weight [V, H] and target ids [T].

    impl: kernel implementation, auto | triton | torch (see `rollart_hpc.kernels.resolve_impl`).
    with_entropy: also report the action-token entropy (`LossDiagnostics.entropy`, `token_entropy`).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    impl: str = "auto"
    with_entropy: bool = False
    tuning: KernelTuning | None = None


def _check_token_shapes(logprobs: torch.Tensor, *others: torch.Tensor) -> None:
    if logprobs.dim() != 1 or any(t.shape != logprobs.shape for t in others):
        raise ValueError(f"per-token inputs must all be 1-D of shape {tuple(logprobs.shape)}")


def _token_inputs(batch: LossBatch, old_logprobs: torch.Tensor, device: torch.device) -> LossInputs:
    return LossInputs(
        batch.action_mask.to(device),
        old_logprobs.to(device),
        batch.behaviour_logprobs.to(device),
        batch.advantages.to(device),
    )


def _fused_terms(
    source: LMHeadInputs,
    batch: LossBatch,
    cfg: LossConfig,
    old_logprobs: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[LossInputs, TokenTerms, torch.Tensor | None]:
    if old_logprobs is None:
        with torch.no_grad():
            old_logprobs = linear_logprob(
                source.hidden, source.weight, source.targets, source.impl, source.tuning
            )
    inputs = _token_inputs(batch, old_logprobs, source.hidden.device)
    if not cfg.in_kernel or cfg.entropy_coef:  # log-probs from the fused head, terms in torch
        logp = linear_logprob(source.hidden, source.weight, source.targets, source.impl, source.tuning)
        terms = ppo_token_terms(logp, *inputs[1:], inputs.action_mask, cfg, cu_seqlens)
        entropy = None
        if source.with_entropy or cfg.entropy_coef:
            entropy = head_entropy(source.hidden, source.weight)
        return inputs, terms, entropy
    fused = fused_token_terms(
        source.hidden,
        source.weight,
        source.targets,
        inputs,
        cfg,
        source.impl,
        source.with_entropy,
        source.tuning,
    )
    return inputs, fused.terms, fused.entropy


def policy_loss(
    source: torch.Tensor | LMHeadInputs,
    batch: LossBatch,
    cfg: LossConfig,
    num_global_action_tokens: int,
    old_logprobs: torch.Tensor | None = None,
    num_global_sequences: int | None = None,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossDiagnostics]:
    """SPO++ policy loss of one micro-batch, aggregated by `cfg.loss_agg`, and its diagnostics.

    source: the current policy's token log-probs [T] with gradient (torch reference), or `LMHeadInputs`
        (fused kernel; the gradient flows to hidden states and LM-head weight).
    batch: behaviour log-probs, per-token advantages and action mask [T]; moved to the source's device.
        Settings that read trajectories (`cfg.needs_sequences`) also read its `cu_seqlens` [B + 1].
    old_logprobs: the proximal policy's log-probs [T]; None takes the current ones, detached (one
        optimizer step per batch: the ratio is 1 at the step's start).
    num_global_action_tokens / num_global_sequences: the step's action tokens and trajectories (with an
        action token) over all micro-batches and ranks: the denominators of `aggregation_weights`
        (token_mean divides by the first, the per-trajectory aggregations by the second).
    entropy: with a log-prob source, the policy's per-token entropy [T] (with its gradient when
        cfg.entropy_coef > 0: the loss subtracts entropy_coef x it, aggregated as the loss); reported as
        `LossDiagnostics.entropy`. `LMHeadInputs` compute it themselves (`with_entropy` or entropy_coef > 0;
        entropy_coef > 0 takes the log-probs from the fused head and the terms and entropy from torch).
    ref_logprobs: with a log-prob source, the reference policy's log-probs [T]: `LossDiagnostics.kl` is
        the token mean of the cfg.kl_estimator estimate of KL(policy || reference); cfg.kl_coef > 0 adds
        kl_coef x it to the loss (kl_in "loss") or subtracts kl_coef x the reward-to-go of the proximal
        policy's estimate from the advantages (kl_in "reward"). Needed when cfg.kl_coef > 0.
    """
    cu_seqlens = getattr(batch, "cu_seqlens", None)
    if cfg.needs_sequences and cu_seqlens is None:
        raise ValueError(f"loss_agg {cfg.loss_agg!r} and sequence-level terms need the batch's cu_seqlens")
    token_kl = None
    if isinstance(source, LMHeadInputs):
        if cfg.kl_coef or ref_logprobs is not None:
            raise ValueError("the KL to a reference policy takes the log-prob source, not LMHeadInputs")
        inputs, terms, entropy = _fused_terms(source, batch, cfg, old_logprobs, cu_seqlens)
    else:
        old = source.detach() if old_logprobs is None else old_logprobs
        inputs = _token_inputs(batch, old, source.device)
        _check_token_shapes(source, *inputs)
        if cfg.kl_coef and ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs the reference policy's log-probs")
        if ref_logprobs is not None:
            ref = ref_logprobs.to(source.device)
            token_kl = kl_estimate(source, ref, inputs.action_mask, cfg.kl_estimator)
            if cfg.kl_coef and cfg.kl_in == "reward":
                penalty = kl_estimate(inputs.old_logprobs, ref, inputs.action_mask, cfg.kl_estimator)
                assert cu_seqlens is not None  # cfg.needs_sequences, checked above
                to_go = reward_to_go(penalty, inputs.action_mask, cu_seqlens)
                shaped = inputs.advantages - cfg.kl_coef * to_go
                inputs = inputs._replace(advantages=shaped.detach())
        terms = ppo_token_terms(
            source,
            inputs.old_logprobs,
            inputs.behaviour_logprobs,
            inputs.advantages,
            inputs.action_mask,
            cfg,
            cu_seqlens,
        )
        if cfg.entropy_coef and entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy of the log-prob source")
        entropy = entropy.to(source.device) if entropy is not None else None
    weights = None
    if cfg.loss_agg != "token_mean":
        weights = aggregation_weights(
            inputs.action_mask,
            cu_seqlens.to(inputs.action_mask.device) if cu_seqlens is not None else None,
            cfg,
            num_global_action_tokens,
            num_global_sequences,
            terms.loss.dtype,
        )
    return reduce_token_terms(
        terms,
        inputs.action_mask,
        inputs.advantages,
        num_global_action_tokens,
        entropy,
        weights,
        cfg.entropy_coef,
        token_kl,
        cfg.kl_coef if cfg.kl_in == "loss" else 0.0,
    )


def _check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with B + 1 entries, got shape {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(
            f"cu_seqlens must run from 0 to T = {num_tokens}, got {int(cu_seqlens[0])}..{int(cu_seqlens[-1])}"
        )
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    return lengths


def broadcast_to_tokens(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-trajectory values [B] -> per-token [T]: trajectory b's value on tokens cu[b]:cu[b+1]."""
    lengths = _check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]) if cu_seqlens.numel() else 0)
    if values.shape != lengths.shape:
        raise ValueError(f"{values.shape[0]} values for {lengths.shape[0]} trajectories in cu_seqlens")
    return torch.repeat_interleave(values, lengths.to(device=values.device, dtype=torch.long))


def packed_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    action_mask: torch.Tensor,
    num_global_action_tokens: int,
    cfg: LossConfig,
    num_global_sequences: int | None = None,
) -> tuple[torch.Tensor, LossDiagnostics]:
    """`policy_loss` of packed trajectories delimited by `cu_seqlens` [B + 1] (0 to T, non-decreasing),
    with `advantages` per trajectory [B], broadcast to their tokens."""
    _check_token_shapes(logprobs, old_logprobs, behaviour_logprobs, action_mask)
    _check_cu_seqlens(cu_seqlens, logprobs.shape[0])
    token_adv = broadcast_to_tokens(advantages.to(logprobs.dtype), cu_seqlens)
    batch = SequenceBatch(action_mask, behaviour_logprobs, token_adv, cu_seqlens)
    return policy_loss(logprobs, batch, cfg, num_global_action_tokens, old_logprobs, num_global_sequences)
