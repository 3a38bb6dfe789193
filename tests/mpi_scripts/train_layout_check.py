"""Trainer worker for the layout tests, run under mpiexec: one world = one (TP, PP, DP) layout.

    train_layout_check.py MODEL_DIR OUT STORE TP PP MICRO_BATCH_TOKENS LOAD_FROM SAVE_TO

Every rank takes its share of the same global batch (`split_across_ranks` over all ranks; the ranks of
one model-parallel group pool theirs). Unless LOAD_FROM is given the world runs RL step 1 and, when
SAVE_TO is given, checkpoints after it; with LOAD_FROM it restores that checkpoint instead. Then it runs
RL step 2 on a second batch. LAYOUT_LOSS_IMPL (fused | eager) picks `trainer.loss_impl`;
LAYOUT_SEQUENCE_PARALLEL=1 turns on sequence parallelism. Rank 0 writes `OUT/result.pt`: each step's metrics, the HF weights
gathered after each step, whether the unit-by-unit gather of the publication path gives the same tensors in
the same order (with the largest unit's tensor count), and whether `save_hf` wrote the last step's weights.
`dist.gather_object` raises while the weights are gathered: they move as tensors.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch


def global_batch(vocab: int, seed: int) -> object:
    from rollart_hpc.train.batch import from_sequences

    gen = torch.Generator().manual_seed(seed)
    lengths = [23, 9, 31, 14, 18, 27, 6, 12]
    tokens = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    for mask in masks:  # an observation span inside the generated part
        mask[len(mask) - 3] = 0
    adv = [[(1.0 - 0.4 * i) * m for m in mask] for i, mask in enumerate(masks)]
    behaviour = [[-6.0 * m for m in mask] for mask in masks]
    return from_sequences(tokens, masks, behaviour, adv)


@contextlib.contextmanager
def _no_pickles() -> Iterator[None]:
    """Publication and save_hf gather tensors: `dist.gather_object` raises meanwhile (Megatron's
    distributed checkpoints still use it for their save plans)."""
    import torch.distributed as dist

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights must be gathered as tensors, not with gather_object")

    saved, dist.gather_object = dist.gather_object, refuse
    try:
        yield
    finally:
        dist.gather_object = saved


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    from rollart_hpc.algo.loss import LossConfig
    from rollart_hpc.train.batch import split_across_ranks
    from rollart_hpc.train.config import OptimConfig, TrainerConfig
    from rollart_hpc.train.trainer import Trainer

    model_dir, out, store, tp, pp, mbt, load_from, save_to = argv
    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = TrainerConfig(
        optim=OptimConfig(lr=1e-4, weight_decay=0.01, grad_clip=1.0),
        micro_batch_tokens=int(mbt),
        collective_timeout_s=120,
        tensor_parallel=int(tp),
        pipeline_parallel=int(pp),
        sequence_parallel=os.environ.get("LAYOUT_SEQUENCE_PARALLEL") == "1",
        loss_impl=os.environ.get("LAYOUT_LOSS_IMPL", "fused"),
        ddp_bucket_elements=40_000,  # several buckets: the overlapped reduction runs bucket by bucket
    )
    trainer = Trainer(model_dir, cfg)
    trainer.load_reference(model_dir)
    # step 1: the default token-mean loss; step 2: per-trajectory aggregation, GSPO's sequence ratio, an
    # entropy bonus and a KL to the reference (k1: its gradient does not vanish at the reference)
    losses = (
        LossConfig(),
        LossConfig(
            loss_agg="seq_mean_token_mean",
            ratio_level="sequence",
            entropy_coef=0.01,
            kl_coef=0.05,
            kl_estimator="k1",
        ),
    )
    result: dict[str, object] = {"metrics": [], "weights": []}
    for step, seed in enumerate((11, 12), start=1):
        if step == 1 and load_from:
            trainer.load_checkpoint(load_from)
            continue
        batch = global_batch(trainer.config.vocab_size, seed)
        shard = split_across_ranks(batch, world)[rank]  # type: ignore[arg-type]
        metrics = trainer.rl_step(shard, batch.num_action_tokens, losses[step - 1])  # type: ignore[attr-defined]
        result["metrics"].append(metrics)  # type: ignore[attr-defined]
        with _no_pickles():
            whole = trainer.hf_state_dict()
            # The publication path: one unit gathered at a time, together the same tensors in the same order.
            units = list(trainer.hf_units())
        result["weights"].append(whole)  # type: ignore[attr-defined]
        merged = {name: t for unit in units for name, t in unit.items()}
        same = list(merged) == list(whole) and all(torch.equal(merged[k], whole[k]) for k in whole)
        result.setdefault("units_match", []).append((same, max(len(u) for u in units) if units else 0))  # type: ignore[attr-defined]
        if step == 1 and save_to:
            trainer.save_checkpoint(save_to)
    with _no_pickles():
        saved = trainer.save_hf(Path(out) / "hf")
    if rank == 0:
        from rollart_hpc.models.checkpoint import load_weights

        last = result["weights"][-1]  # type: ignore[index]
        on_disk = load_weights(saved)
        result["saved_match"] = set(on_disk) == set(last) and all(
            torch.equal(on_disk[k], last[k]) for k in last
        )
        torch.save(result, Path(out) / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
