"""Trainer checkpoints with Megatron's `dist_checkpointing`: model, optimizer state and step; atomic.

Layout: `<dir>/` holds the torch_dist files (`metadata.json`, `.metadata`, `__*.distcp`, `common.pt`) and,
written last, the marker `COMPLETE` (JSON with the step). Writers fill `.<name>.tmp` next to `<dir>` and
rank 0 renames it to `<dir>` once every rank has finished, then writes the marker; a reader trusts a
directory only when the marker exists. All ranks call save and load together (collectives inside).

Tensors are stored under their global (unsharded) keys, so a checkpoint saved at one (TP, PP, DP)
layout loads at any other: the model through `GPTModel.sharded_state_dict()`, the optimizer through
Megatron's `sharded_state_dict` (the distributed optimizer in its `fully_reshardable` form; under bf16
training its state holds the fp32 main parameters, which a resume restores exactly). Without
Apex/Transformer Engine Megatron's optimizer load path needs four repairs, applied here: a never-stepped
optimizer gets zero Adam states (so its load template exists), a loaded `step` is never copied from the
template, the fp32 shard copy runs without autograd, and every parameter gets its own `step` tensor (a
shared one would be incremented once per parameter). Requires psutil (dist_checkpointing's writer
processes hang without it) and, in a script, an `if __name__ == "__main__":` guard (the first save starts
a spawn-context multiprocessing Manager).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.train import comm, parallel

SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
_patched = False
MARKER = "COMPLETE"


def is_complete(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def checkpoint_step(directory: str | Path) -> int:
    """The step recorded in a complete checkpoint's marker."""
    return int(json.loads((Path(directory) / MARKER).read_text())["step"])


def _init_adam_state(optimizer: Any) -> None:
    for inner in parallel.torch_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )


def _patch_distributed_optimizer() -> None:
    """Megatron's fp32 DistributedOptimizer copies every loaded state into the parameter's, `step`
    included (a template's `step` then overwrites the loaded one, or is missing): skip `step`."""
    global _patched
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if _patched:
        return

    def set_states(self: Any, model_param: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        group_index, order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][order]
        for key, dst in {"param": main, **self.optimizer.state[main]}.items():
            if key in tensors and key != "step":
                dst.copy_(tensors[key])

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    _patched = True


def _sharded_state(model: Any, optimizer: Any, step: int, loading: bool) -> dict[str, Any]:
    _init_adam_state(optimizer)
    model_sharded = model.sharded_state_dict()
    opt_sharded = optimizer.sharded_state_dict(model_sharded, is_loading=loading, metadata=SHARDING)
    return {"model": model_sharded, "optimizer": opt_sharded, "step": step}


def _prepare_dirs(final: Path, tmp: Path) -> None:
    if is_complete(final):
        raise FileExistsError(f"checkpoint {final} already exists (it has its {MARKER} marker)")
    for stale in (tmp, final):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir(parents=True)


def save(directory: str | Path, model: Any, optimizer: Any, step: int, timeout_s: float) -> Path:
    """Write a checkpoint of (model shard, optimizer, step) to `directory`, which must not hold a
    complete one; `model` is the unwrapped GPTModel."""
    from megatron.core import dist_checkpointing

    final = Path(directory).absolute()
    tmp = final.with_name(f".{final.name}.tmp")
    device = next(model.parameters()).device
    if comm.rank() == 0:
        _prepare_dirs(final, tmp)
    comm.barrier("checkpoint directory ready", timeout_s, device)
    dist_checkpointing.save(_sharded_state(model, optimizer, step, False), str(tmp))
    comm.barrier("checkpoint shards written", timeout_s, device)
    if comm.rank() == 0:
        tmp.rename(final)
        atomic_write_json(final / MARKER, {"step": step})
    comm.barrier("checkpoint published", timeout_s, device)
    return final


def load(directory: str | Path, model: Any, optimizer: Any) -> int:
    """Restore model shard and optimizer from a complete checkpoint of any layout (all ranks together);
    return its step."""
    from megatron.core import dist_checkpointing

    folder = Path(directory).absolute()
    if not is_complete(folder):
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {MARKER} marker)")
    _patch_distributed_optimizer()
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, 0, True), str(folder))
    model.load_state_dict(loaded["model"], strict=False)
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    for inner in parallel.torch_optimizers(optimizer):
        for state in inner.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()
    return int(loaded["step"])
