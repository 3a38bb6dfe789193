"""Trainer checkpoints with Megatron's `dist_checkpointing`: model, AdamW state and step; atomic.

Layout: `<dir>/` holds the torch_dist files (`metadata.json`, `.metadata`, `__*.distcp`, `common.pt`) and,
written last, the marker `COMPLETE` (JSON with the step). Writers fill `.<name>.tmp` next to `<dir>` and
rank 0 renames it to `<dir>` once every rank has finished, then writes the marker; a reader trusts a
directory only when the marker exists. All ranks call save and load together (collectives inside).

AdamW keeps one `step` tensor per parameter; they are equal, so the checkpoint stores one common step and
restores a separate tensor per parameter (a shared one would be incremented once per parameter).
Requires psutil (dist_checkpointing's writer processes hang without it) and, in a script, an
`if __name__ == "__main__":` guard (the first save starts a spawn-context multiprocessing Manager).
"""

from __future__ import annotations

import json
import shutil
from itertools import chain
from pathlib import Path
from typing import Any

import torch

from rollart_hpc.contracts.atomic import atomic_write_json
from rollart_hpc.train import comm

MARKER = "COMPLETE"


def is_complete(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def checkpoint_step(directory: str | Path) -> int:
    """The step recorded in a complete checkpoint's marker."""
    return int(json.loads((Path(directory) / MARKER).read_text())["step"])


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p].update(
                    step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                )


def _common_step(state: dict[Any, dict[str, Any]]) -> float:
    steps = {float(s["step"]) for s in state.values()}
    if len(steps) != 1:
        raise ValueError(f"AdamW parameters have different step counts {sorted(steps)}; expected one")
    return steps.pop()


def _optimizer_sharded(optimizer: torch.optim.Optimizer, model_sharded: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    _init_adam_state(optimizer)
    state = optimizer.state_dict()
    params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    id_map = get_param_id_to_sharded_param_map(model_sharded, params)
    step = _common_step(state["state"])
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    return {"adamw": state, "common_step": step}


def _sharded_state(model: Any, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_sharded = model.sharded_state_dict()
    return {"model": model_sharded, "optimizer": _optimizer_sharded(optimizer, model_sharded), "step": step}


def _prepare_dirs(final: Path, tmp: Path) -> None:
    if is_complete(final):
        raise FileExistsError(f"checkpoint {final} already exists (it has its {MARKER} marker)")
    for stale in (tmp, final):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir(parents=True)


def save(
    directory: str | Path, model: Any, optimizer: torch.optim.Optimizer, step: int, timeout_s: float
) -> Path:
    """Write a checkpoint of (model, optimizer, step) to `directory`, which must not hold a complete one."""
    from megatron.core import dist_checkpointing

    final = Path(directory).absolute()
    tmp = final.with_name(f".{final.name}.tmp")
    device = next(model.parameters()).device
    if comm.rank() == 0:
        _prepare_dirs(final, tmp)
    comm.barrier("checkpoint directory ready", timeout_s, device)
    dist_checkpointing.save(_sharded_state(model, optimizer, step), str(tmp))
    comm.barrier("checkpoint shards written", timeout_s, device)
    if comm.rank() == 0:
        tmp.rename(final)
        atomic_write_json(final / MARKER, {"step": step})
    comm.barrier("checkpoint published", timeout_s, device)
    return final


def _restore_optimizer(optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    state = loaded["adamw"]
    for param_state in state["state"].values():
        param_state["step"] = torch.tensor(float(loaded["common_step"]))
    optimizer.load_state_dict(state)


def load(directory: str | Path, model: Any, optimizer: torch.optim.Optimizer) -> int:
    """Restore model and optimizer from a complete checkpoint (all ranks together); return its step."""
    from megatron.core import dist_checkpointing

    folder = Path(directory).absolute()
    if not is_complete(folder):
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {MARKER} marker)")
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, 0), str(folder))
    model.load_state_dict(loaded["model"])
    _restore_optimizer(optimizer, loaded["optimizer"])
    return int(loaded["step"])
