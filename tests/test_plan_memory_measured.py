"""The memory plan against a real trainer on CPU: one gloo rank builds a tiny model through the project's
Trainer and takes SFT steps. The planned parameter, gradient and Adam bytes are compared with the bytes of
the tensors that exist (parameters, Megatron DDP's gradient buffers, the optimizer's state), and the planned
activations with the peak of the storage that a step's forward, backward and optimizer step allocate and
still hold (`LiveStorage`). The CPU trainer runs fp32 and whichever attention its config names; what only a
GPU shows is listed in `rollart_hpc.plan.memory`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rollart_hpc.config import load_config
from rollart_hpc.plan import memory
from rollart_hpc.plan.ranks import memory_plan
from rollart_hpc.train import convert, lm_head
from rollart_hpc.train.batch import PackedBatch, from_sequences
from rollart_hpc.train.config import OptimConfig, TrainerConfig
from rollart_hpc.train.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
TOKENS = 2048  # one micro-batch of 512- or 1024-token rows: its activations dominate the 2 M parameters
ACTIVATION_TERMS = ("activations", "backward_transient", "head_input", "logits", "recompute_layer")


class LiveStorage(TorchDispatchMode):
    """Bytes of the storages that ops allocated under this mode and that are still alive; `peak` is their
    most. A storage is watched from the op that returned it (not one of the op's inputs) until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for ptr, (ref, size) in list(self.live.items()):
            if ref.expired():
                del self.live[ptr]
                self.current -= size
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self.live and ptr not in inputs:
                self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
        return out


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rollart_hpc.models.tiny import make_tiny_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port
    folder = make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "llama", family="llama", hidden_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, vocab_size=512, tie_word_embeddings=True,
    )  # fmt: skip
    yield Trainer(folder, TrainerConfig(optim=OptimConfig(lr=1e-3), micro_batch_tokens=TOKENS))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _batch(row: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 400, (row,), generator=gen).tolist() for _ in range(TOKENS // row)]
    masks = [[0] + [1] * (row - 1) for _ in tokens]
    zeros = [[0.0] * row for _ in tokens]
    return from_sequences(tokens, masks, zeros, zeros)


def _planned(trainer: Trainer, row: int) -> dict[str, int]:
    """The plan's terms for this trainer: its model directory, micro-batch, rows and attention."""
    attention = getattr(trainer.cfg, "attention", "unfused")  # the local DotProductAttention by default
    config = load_config(
        REPO / "configs" / "tiny.toml",
        [
            "model.source=path",
            f"model.path={trainer.model_dir}",
            f"trainer.micro_batch_tokens={TOKENS}",
            f"rollout.max_model_len={row}",
            f"trainer.attention={attention}",
        ],
    )
    (rank,) = [r for r in memory_plan(config).ranks if r.role == "trainer"]
    return rank.terms


def _storage_bytes(tensors: Iterator[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _optimizer_state(trainer: Trainer) -> Iterator[torch.Tensor]:
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for state in opt.optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


def test_planned_parameters_gradients_and_adam_states_match_the_tensors(trainer: Trainer) -> None:
    trainer.sft_step(_batch(512))  # Adam's moments exist after the first step
    plan = _planned(trainer, 512)
    measured = {
        "params": _storage_bytes(iter(trainer.params)),
        "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in trainer.model.buffers),
        "adam": _storage_bytes(_optimizer_state(trainer)),
    }
    print("\nstate bytes, planned / measured:", {k: (plan[k], v) for k, v in measured.items()})
    for name, size in measured.items():
        assert plan[name] == pytest.approx(size, rel=0.2), name
    assert sum(plan[k] for k in measured) == pytest.approx(sum(measured.values()), rel=0.2)


@pytest.mark.parametrize("row", [512, 1024])
def test_planned_activations_match_the_peak_of_live_storage_in_a_step(trainer: Trainer, row: int) -> None:
    batch = _batch(row)
    trainer.sft_step(batch)  # states allocated: the step below allocates only what a step needs
    with LiveStorage() as live:
        trainer.sft_step(batch)
    plan = _planned(trainer, row)
    planned = sum(plan.get(k, 0) for k in ACTIVATION_TERMS)
    terms = {k: plan[k] for k in ACTIVATION_TERMS if k in plan}
    print(f"\nrows of {row}: planned {planned} ({terms}), measured peak {live.peak}")
    state = plan["params"] + plan["grads"] + plan["adam"]
    assert planned > 4 * state  # a size where the activations dominate
    assert live.peak == pytest.approx(planned, rel=0.2), (live.peak, plan)
    assert live.current < 0.05 * live.peak  # the step frees what it allocated


def test_the_plans_constants_are_the_trainers() -> None:
    assert memory.LOGITS_CHUNK_ELEMENTS == lm_head.LOGITS_BUDGET_ELEMENTS
    assert all(memory.padded_vocab(v) == convert.padded_vocab_size(v) for v in (1, 489, 151936, 152064))
