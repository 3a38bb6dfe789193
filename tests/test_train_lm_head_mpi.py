"""The vocabulary-parallel LM head at TP 2 across two real processes (mpiexec, gloo): the Triton kernel path
of `train.lm_head.head_logprobs` (interpreted on CPU) against its chunked torch path and a float64 reference.

Vocabulary 100 padded to 128, split in two shards of 64 rows: rank 0 holds rows 0-63, rank 1 rows 64-127 of
which 100-127 are padding (masked inside the kernel). Each rank computes its shard's partial max, sum-exp and
target logit, combined over the TP group; its backward gives this shard's d weight and its part of d hidden,
summed over TP by Megatron's copy-to-TP region, or (sequence parallel) by the reduce-scatter of the
sequence-parallel gather's backward. The detached entropy of the same pass (`head_logprobs_entropy`) is the
whole head's. fp32: 1e-5 relative in log-probs and gradients; bf16: 2e-2.

There is no CUDA version of this test: NCCL puts no two ranks of one communicator on one GPU, so it needs
two GPUs (listed in scripts/gpu_check.sh's header among the checks one GPU cannot run). On one GPU the
kernel runs compiled on a padded head shard at TP 1 (tests/test_train_lm_head.py's `gpu` test).

Run as a script under mpiexec, this file is the worker (`_worker`); pytest starts it once.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.mpi]

TOKENS, HIDDEN, VOCAB, PADDED, TP = 12, 32, 100, 128, 2
DTYPES = {"fp32": (torch.float32, 1e-5), "bf16": (torch.bfloat16, 2e-2)}
MODES = ("copy_to_tp", "sequence_parallel")


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H], the padded head [128, H] (padding rows large: unmasked they would dominate),
    targets [N] in both shards, and the upstream gradient of the log-probs [N]."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(PADDED, HIDDEN, generator=gen) * 0.3).to(dtype)
    weight[VOCAB:] = 50.0
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    targets[:3] = torch.tensor([0, PADDED // TP - 1, VOCAB - 1])  # the shards' edges
    return hidden, weight, targets, torch.linspace(-1.0, 1.0, TOKENS)


def _worker(out: str, store: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from rollart_hpc.train.lm_head import LMHead, head_logprobs_entropy
    from rollart_hpc.train.megatron_compat import apply_cpu_patches

    apply_cpu_patches()  # the sequence-parallel gather allocates on torch.cuda.current_device()
    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    assert world == TP
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    shard = PADDED // TP
    result: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, (dtype, _) in DTYPES.items():
        hidden_all, weight_all, targets, upstream = _data(dtype)
        for mode in MODES:
            for impl in ("triton", "torch"):
                weight = weight_all[rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
                if mode == "copy_to_tp":
                    leaf = hidden_all.clone().requires_grad_(True)
                    hidden = leaf
                else:  # this rank's tokens, gathered as the trainer's sequence-parallel output is
                    rows = TOKENS // TP
                    leaf = hidden_all[rank * rows : (rank + 1) * rows].clone().requires_grad_(True)
                    hidden = tensor_parallel.gather_from_sequence_parallel_region(
                        leaf, tensor_parallel_output_grad=True
                    )
                head = LMHead(VOCAB, TP, 60.0, copy_to_tp=mode == "copy_to_tp", impl=impl)
                lp, entropy = head_logprobs_entropy(head, hidden, weight, targets)
                (lp * upstream).sum().backward()
                assert leaf.grad is not None and weight.grad is not None
                result[f"{name}/{mode}/{impl}"] = (lp.detach(), leaf.grad, weight.grad, entropy)
    torch.save(result, Path(out) / f"result-{rank}.pt")
    dist.destroy_process_group()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _reference(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 log-probs, d hidden, d weight and entropy of the whole (unsharded) head on the same values."""
    hidden_all, weight_all, targets, upstream = _data(dtype)
    h = hidden_all.double().requires_grad_(True)
    w = weight_all.double().requires_grad_(True)
    logits = (h @ w.T)[:, :VOCAB]
    lp = torch.log_softmax(logits, dim=1).gather(1, targets[:, None])[:, 0]
    (lp * upstream.double()).sum().backward()
    assert h.grad is not None and w.grad is not None
    entropy = -(torch.softmax(logits, 1) * torch.log_softmax(logits, 1)).sum(1)
    return lp.detach(), h.grad, w.grad, entropy.detach()


def test_triton_kernel_at_tp2_matches_the_torch_path_and_the_whole_head(tmp_path: Path) -> None:
    from launching import mpiexec_run

    store = tmp_path / f"store-{uuid.uuid4().hex}"  # a file store: no port to race for
    mpiexec_run(TP, __file__, tmp_path, store, env={"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"})
    ranks = [torch.load(tmp_path / f"result-{r}.pt") for r in range(TP)]
    shard, rows = PADDED // TP, TOKENS // TP
    for name, (dtype, tol) in DTYPES.items():
        ref_lp, ref_gh, ref_gw, ref_entropy = _reference(dtype)
        # float64 of the same rounded values: the fp32 paths within their own tolerance, bf16 gradients
        # within bf16 rounding of d logits and of the result
        ref_tol = 1e-5 if dtype == torch.float32 else 2e-2
        for mode in MODES:
            for rank, result in enumerate(ranks):
                lp_k, gh_k, gw_k, ent_k = result[f"{name}/{mode}/triton"]
                lp_t, gh_t, gw_t, ent_t = result[f"{name}/{mode}/torch"]
                where = f"{name} {mode} rank {rank}"
                # the detached entropy of the same pass: the whole head's, every token, on every rank
                assert _rel(ent_k, ref_entropy) < ref_tol and _rel(ent_t, ref_entropy) < ref_tol, where
                assert lp_k.dtype == torch.float32 and gh_k.dtype == gw_k.dtype == dtype, where
                assert _rel(lp_k, lp_t) < tol, where
                assert _rel(gh_k, gh_t) < tol and _rel(gw_k, gw_t) < tol, where
                want_gh = ref_gh if mode == "copy_to_tp" else ref_gh[rank * rows : (rank + 1) * rows]
                assert _rel(lp_k, ref_lp) < ref_tol and _rel(gh_k, want_gh) < ref_tol, where
                assert _rel(gw_k, ref_gw[rank * shard : (rank + 1) * shard]) < ref_tol, where
            # rank 1's padding rows (100-127) get no gradient on either path
            for impl in ("triton", "torch"):
                assert bool((ranks[1][f"{name}/{mode}/{impl}"][2][VOCAB - shard :] == 0).all())


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
