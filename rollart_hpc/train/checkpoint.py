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

Background saves (`start_save` -> `PendingSave.finish`): Megatron plans the save and writes `common.pt` at
once (collectives inside), the shards to write are copied to host memory (a snapshot: training may change
the parameters the moment `start_save` returns), and a thread of this rank writes them with Megatron's
own shard writer. `finish` is collective and called by every rank at the same points (the trainer's
next message): it all-reduces "my writer is done" and, only when every rank's files are written and
fsynced, runs Megatron's finalization (the `.metadata` and `metadata.json`), renames the temporary
directory and writes the marker, exactly as a synchronous save does. A rank that dies while its writer
runs leaves `.<name>.tmp` without a marker, so the previous complete checkpoint stays the resume point.
The writer waits for `gate` (a file) to exist when one is given: tests hold a save in flight with it.
"""

from __future__ import annotations

import json
import queue
import shutil
import threading
from dataclasses import dataclass, field
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


def _prepare_dirs(directory: str | Path, model: Any, timeout_s: float) -> tuple[Path, Path, Any]:
    """(final directory, its temporary sibling, the model's device) of a save to `directory`: rank 0 clears
    stale ones and creates the temporary one, then every rank waits for it."""
    final = Path(directory).absolute()
    tmp = final.with_name(f".{final.name}.tmp")
    device = next(model.parameters()).device
    if comm.rank() == 0:
        if is_complete(final):
            raise FileExistsError(f"checkpoint {final} already exists (it has its {MARKER} marker)")
        for stale in (tmp, final):
            if stale.exists():
                shutil.rmtree(stale)
        tmp.mkdir(parents=True)
    comm.barrier("checkpoint directory ready", timeout_s, device)
    return final, tmp, device


def save(directory: str | Path, model: Any, optimizer: Any, step: int, timeout_s: float) -> Path:
    """Write a checkpoint of (model shard, optimizer, step) to `directory`, which must not hold a
    complete one; `model` is the unwrapped GPTModel."""
    from megatron.core import dist_checkpointing

    final, tmp, device = _prepare_dirs(directory, model, timeout_s)
    dist_checkpointing.save(_sharded_state(model, optimizer, step, False), str(tmp))
    _publish(final, tmp, step, timeout_s, device)
    return final


def start_save(
    directory: str | Path, model: Any, optimizer: Any, step: int, timeout_s: float, gate: Path | None = None
) -> PendingSave:
    """Begin a background save of (model shard, optimizer, step) to `directory` (all ranks together); the
    shards are copied to host memory before this returns. Complete it with `PendingSave.finish`."""
    from megatron.core import dist_checkpointing

    final, tmp, device = _prepare_dirs(directory, model, timeout_s)
    request = dist_checkpointing.save(
        _sharded_state(model, optimizer, step, False), str(tmp), async_sharded_save=True
    )
    pending = PendingSave(final, tmp, step, timeout_s, device, request, gate)
    pending.start()
    return pending


def _snapshot(buckets: list[Any]) -> list[Any]:
    """Megatron write buckets with every tensor copied to host memory (never aliasing a live tensor)."""
    return [
        (name, key, (data, [(item, t.detach().to("cpu", copy=True)) for item, t in tensors]))
        for name, key, (data, tensors) in buckets
    ]


@dataclass
class PendingSave:
    """One rank's share of a background save (see the module docstring)."""

    final: Path
    tmp: Path
    step: int
    timeout_s: float
    device: Any
    request: Any  # megatron AsyncRequest: async_fn/args write this rank's buckets, finalize_fns publish
    gate: Path | None = None
    nbytes: int = 0  # tensor bytes this rank writes
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> None:
        if self.request.async_fn is None:  # nothing to write on this rank
            return
        _, buckets, results = self.request.async_fn_args
        buckets = _snapshot(buckets)
        self.nbytes = sum(t.numel() * t.element_size() for _, _, (_, ts) in buckets for _, t in ts)
        self._thread = threading.Thread(
            target=self._write, args=(buckets, results), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def _write(self, buckets: list[Any], results: Any) -> None:
        """Write every bucket here (no forked writers: this thread runs beside training) and hand Megatron's
        finalization the per-bucket results, or the first exception."""
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        transforms = self.request.async_fn.args[0]  # partial(write_preloaded_data_multiproc, transforms, ...)
        wait_for_file(self.gate)
        local: queue.Queue[Any] = queue.Queue()
        count: queue.Queue[int] = queue.Queue()
        out: dict[int, Any] | Exception = {}
        for i, bucket in enumerate(buckets):
            count.put(i)
            FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, local, count, True)
            idx, written = local.get()
            if isinstance(written, Exception):
                out = written
                break
            assert isinstance(out, dict)
            out[idx] = written
        results.put(out)

    @property
    def written(self) -> bool:
        """This rank's files are written (or it had none)."""
        return self._thread is None or not self._thread.is_alive()

    def finish(self, blocking: bool) -> bool:
        """Collective: publish the checkpoint once every rank's writer is done (True), else return False
        at once (`blocking` waits for this rank's writer first)."""
        if blocking and self._thread is not None:
            self._thread.join()
        done = torch.tensor([1.0 if self.written else 0.0], device=self.device)
        comm.all_reduce(done, "checkpoint writers done", self.timeout_s, torch.distributed.ReduceOp.MIN)
        if not float(done.item()):
            return False
        for finalize in self.request.finalize_fns:
            finalize()
        _publish(self.final, self.tmp, self.step, self.timeout_s, self.device)
        return True


def wait_for_file(path: Path | None) -> None:
    """Return once `path` exists (at once for None)."""
    if path is None:
        return
    tick = threading.Event()
    while not path.exists():
        tick.wait(0.005)


def _publish(final: Path, tmp: Path, step: int, timeout_s: float, device: Any) -> None:
    comm.barrier("checkpoint shards written", timeout_s, device)
    if comm.rank() == 0:
        tmp.rename(final)
        atomic_write_json(final / MARKER, {"step": step})
    comm.barrier("checkpoint published", timeout_s, device)


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
