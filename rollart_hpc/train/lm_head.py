"""Per-token log-probs of the LM head from the last hidden states, never the [tokens, vocab] logits.

`head_logprobs(LMHead(vocab_size, tp_size, timeout_s), hidden [N, H], weight [V/TP, H], targets [N])`
returns log p(target) [N], with gradients to the hidden states and the weight shard. The head may hold padding rows past
`vocab_size` (`convert.padded_vocab_size`); their logits are masked out. Both that and the
vocabulary-parallel head (rank r holds rows [r V/TP, (r+1) V/TP)) go through the kernels' `head_logprob`:
each rank's log-sum-exp and target logit over its shard are combined over the TP group (max, then sum of
rescaled exp, then sum: three all-reduces of [N] per call), and the backward recomputes this shard's
logits from the saved global log-sum-exp, giving this shard's part of d hidden and its d weight. The
shard's partials and its backward come from the Triton kernel (`lm_head_triton.shard_partials` / `grads`:
padding columns masked in the kernel) or from its torch reference (`lm_head_reference`, logits a chunk of
tokens at a time). Implementation (`impl`, as `kernels.resolve_impl`): "auto" reads ROLLART_KERNEL_IMPL,
then takes Triton on CUDA and torch on CPU (the Triton interpreter only in tests). The hidden states must
enter through Megatron's `copy_to_tensor_model_parallel_region` (done here), whose backward sums the
partial hidden-state gradients over the TP group.

Entropy: `head_logprobs_entropy` also returns the softmax entropy per token, detached, from the same logit
tiles or chunks (each shard's entropy, then under TP the entropy of the mixture of the shards' softmaxes,
sum_r w_r (H_r - log w_r) with w_r = exp(lse_r - lse): one more all-reduce of [N]); the trainer logs it
when the loss has no entropy term. `token_entropy` is the differentiable one (a pass of its own).

Precision: bf16 hidden states and weights (`trainer.precision = "bf16"`) are multiplied with fp32
accumulation on every path (the kernels' fp32 accumulators, the fp32 chunk logits here); the log-probs
are fp32 and the gradients return in the inputs' dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rollart_hpc.kernels.common import KernelTuning, budget_chunk, mask_columns
from rollart_hpc.train import comm

LOGITS_BUDGET_ELEMENTS = 1 << 22  # float32 logits held per chunk (16 MiB)
_TUNING = KernelTuning()  # the kernels' device defaults


def _chunk(num_vocab: int) -> int:
    return budget_chunk(num_vocab, LOGITS_BUDGET_ELEMENTS)


def _reducer(group: Any, what: str, timeout_s: float) -> Callable[[torch.Tensor, str], torch.Tensor]:
    """The kernels' `reduce` over the tensor-parallel group: in place, op "max" or "sum"."""

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        kind = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        return comm.all_reduce(tensor, f"vocab-parallel {what} {op}", timeout_s, kind, group)

    return reduce


@dataclass(frozen=True)
class LMHead:
    """The fixed arguments of the (vocabulary-parallel, padded) LM head, built once by its caller.

    vocab_size: the real rows (the head may hold padding past them); tp_size: the tensor-parallel degree;
    timeout_s: of the all-reduces over the TP group. copy_to_tp=False: the caller's hidden states already
    sum their gradient over the TP group (they come from a sequence-parallel gather). impl: auto | triton |
    torch, the kernels' implementation (see the module docstring)."""

    vocab_size: int
    tp_size: int
    timeout_s: float
    copy_to_tp: bool = True
    impl: str = "auto"

    def tp_hidden(
        self, hidden: torch.Tensor, what: str
    ) -> tuple[torch.Tensor, int, Callable[[torch.Tensor, str], torch.Tensor] | None]:
        """(the hidden states entering the TP region, this rank in the TP group, the kernels' `reduce`
        over it, named `what` in errors; None at TP 1)."""
        if self.tp_size == 1:
            return hidden, 0, None
        from megatron.core import parallel_state, tensor_parallel

        group = parallel_state.get_tensor_model_parallel_group()
        if self.copy_to_tp:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
        return hidden, dist.get_rank(group), _reducer(group, what, self.timeout_s)


def head_logprobs(
    head: LMHead, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """log p(target) [N] (fp32) of hidden [N, H] under the (vocabulary-parallel, padded) head `weight`."""
    return _head(head, hidden, weight, targets, False)[0]


def head_logprobs_entropy(
    head: LMHead, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_logprobs` and the policy's entropy [N] (fp32, detached) from the same logit tiles or chunks:
    no second pass over the head (under TP one more all-reduce of [N]). The entropy carries no gradient;
    `token_entropy` is the differentiable one."""
    lp, entropy = _head(head, hidden, weight, targets, True)
    assert entropy is not None
    return lp, entropy


def _head(
    head: LMHead, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from rollart_hpc.kernels.policy_loss import head_logprob, resolve_impl

    impl = "triton" if resolve_impl(head.impl, hidden.device) == "triton" else "torch"
    if head.tp_size == 1 and weight.shape[0] == head.vocab_size:
        # The torch reference holds one chunk of logits at a time: the same budget as the path below.
        tuning = None if hidden.is_cuda else KernelTuning(token_chunk=_chunk(head.vocab_size))
        lp, ent = head_logprob(hidden, weight, targets, impl, tuning, with_entropy)
        return lp.float(), ent.float() if with_entropy else None
    hidden, rank, reduce = head.tp_hidden(hidden, "log-prob")
    vocab = weight.shape[0]
    real = max(0, min(vocab, head.vocab_size - rank * vocab))  # this shard's rows that are not padding
    local = targets - rank * vocab
    local = torch.where((local >= 0) & (local < vocab), local, -1)  # -1: another shard's target
    # The torch reference holds one chunk of logits at a time: `LOGITS_BUDGET_ELEMENTS`.
    tuning = _TUNING if impl == "triton" else KernelTuning(token_chunk=_chunk(vocab))
    lp, ent = head_logprob(hidden, weight, local, impl, tuning, with_entropy, real, reduce)
    return lp.float(), ent.float() if with_entropy else None


def token_logprobs(
    impl: str, head: LMHead, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The trainer's log p(target) [N] from the last hidden states [N, H] and the head shard [V/TP, H].

    impl "fused": `head_logprobs` (never [N, V] logits). "eager": the full (vocabulary-parallel)
    logits, padding columns masked, through Megatron's vocab-parallel cross-entropy, exactly what the
    model's own output layer and loss compute."""
    return token_logprobs_entropy(impl, head, hidden, weight, targets, False)[0]


def token_logprobs_entropy(
    impl: str,
    head: LMHead,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` and, `with_entropy` under impl "fused", the detached per-token entropy [N] from
    the same pass (`head_logprobs_entropy`); None otherwise ("eager" has no fused pass to share)."""
    if impl == "fused":
        return _head(head, hidden, weight, targets, with_entropy)
    from megatron.core import parallel_state, tensor_parallel

    if head.tp_size > 1 and head.copy_to_tp:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    logits = mask_padding(
        hidden.float() @ weight.float().T, head.vocab_size, parallel_state.get_tensor_model_parallel_rank()
    )
    ce: torch.Tensor = tensor_parallel.vocab_parallel_cross_entropy(logits, targets)
    return -ce, None


def mask_padding(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Vocabulary-parallel logits [..., V/TP] with the padding columns of this shard set to -inf."""
    shard = logits.shape[-1]
    return mask_columns(logits, max(0, min(shard, vocab_size - tp_rank * shard)))


def token_entropy(head: LMHead, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The policy's entropy [N] (fp32) per token from the last hidden states [N, H] and the (vocabulary-
    parallel, padded) head shard, with its gradient (`rollart_hpc.kernels.entropy.head_entropy`: logits
    a chunk of tokens at a time, padding masked; under TP two sums and a max over the group)."""
    from rollart_hpc.kernels.entropy import head_entropy

    hidden, rank, reduce = head.tp_hidden(hidden, "entropy")
    real = head.vocab_size - rank * weight.shape[0]
    return head_entropy(hidden, weight, real, reduce, _chunk(weight.shape[0])).float()
