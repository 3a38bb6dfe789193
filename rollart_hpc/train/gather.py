"""The HF weights of the first data-parallel replica, gathered unit by unit as tensors on trainer rank 0.

Dataflow of one unit (`convert.hf_units`: the embedding, the final norm and head, each layer): the
ranks of the pipeline stage that holds it gather their tensor-parallel shards of each entry on the
stage's first tensor-parallel rank (`dist.gather` over the tensor-parallel group, into tensors it
allocates per entry: shards have equal shapes), which converts them to HF tensors (`convert.unit_to_hf`);
a stage other than the first then sends them, in name order, to trainer rank 0 (`dist.send`), which
receives them into tensors it allocates from the model's HF shapes (`expected_shapes`) and the dtypes
the sender announces first (one small int64 tensor). No object is pickled; no rank holds more than its
own shard plus one unit. All ranks of the first replica iterate together (one gather per entry, one
send per tensor of a unit off the first stage), in the same order; other replicas get nothing.
Every collective is bounded by the timeout of the trainer's groups.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from rollart_hpc.models.checkpoint import expected_shapes
from rollart_hpc.models.config import ModelConfig
from rollart_hpc.train.convert import hf_units as convert_units
from rollart_hpc.train.convert import stage_layers, unit_entries, unit_to_hf
from rollart_hpc.train.model import Layout

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def unit_stage(unit: tuple[str, int], num_layers: int, pp_size: int) -> int:
    """The pipeline stage that holds `unit`."""
    kind, index = unit
    if kind == "embed":
        return 0
    if kind == "final":
        return pp_size - 1
    return next(s for s in range(pp_size) if index in stage_layers(num_layers, s, pp_size))


def unit_names(cfg: ModelConfig, unit: tuple[str, int]) -> list[str]:
    """The HF names of `unit`, sorted."""
    kind, index = unit
    names = expected_shapes(cfg)
    if kind == "embed":
        return ["model.embed_tokens.weight"]
    if kind == "final":
        return sorted(n for n in names if n in ("model.norm.weight", "lm_head.weight"))
    return sorted(n for n in names if n.startswith(f"model.layers.{index}."))


def gather_tp(
    entries: dict[str, torch.Tensor], group: dist.ProcessGroup
) -> list[dict[str, torch.Tensor]] | None:
    """Every tensor-parallel rank's `entries` on the group's first rank (in rank order), None elsewhere."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    dst = dist.get_process_group_ranks(group)[0]
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for name in sorted(entries):
        mine = entries[name].detach().contiguous()
        parts = [torch.empty_like(mine) for _ in range(size)] if me == 0 else None
        dist.gather(mine, parts, dst=dst, group=group)
        for rank, part in enumerate(parts or []):
            shards[rank][name] = part
    return shards if me == 0 else None


def _send_unit(hf: dict[str, torch.Tensor], dst: int) -> None:
    names = sorted(hf)
    dist.send(torch.tensor([DTYPES.index(hf[n].dtype) for n in names], dtype=torch.int64), dst)
    for name in names:
        dist.send(hf[name].contiguous(), dst)


def _recv_unit(cfg: ModelConfig, unit: tuple[str, int], src: int) -> dict[str, torch.Tensor]:
    names, shapes = unit_names(cfg, unit), expected_shapes(cfg)
    codes = torch.empty(len(names), dtype=torch.int64)
    dist.recv(codes, src)
    out = {}
    for name, code in zip(names, codes.tolist(), strict=True):
        out[name] = torch.empty(shapes[name], dtype=DTYPES[code])
        dist.recv(out[name], src)
    return out


def gather_hf_units(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    lay: Layout,
    tp_group: dist.ProcessGroup,
    pp_ranks: list[int],
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield each unit's HF tensors on the replica's first rank ({} on the others); see the module
    docstring. `state`: this rank's Megatron shard (global layer numbers); `pp_ranks`: the global ranks
    of this rank's pipeline group, stage by stage."""
    first = lay.tp_rank == 0 and lay.pp_rank == 0
    for unit in convert_units(cfg.num_layers, lay.pp_size):
        stage = unit_stage(unit, cfg.num_layers, lay.pp_size)
        hf: dict[str, torch.Tensor] = {}
        if lay.pp_rank == stage:
            shards = gather_tp(unit_entries(state, unit), tp_group)
            if shards is not None:
                hf = unit_to_hf(shards, cfg, unit)
        if stage != 0 and lay.tp_rank == 0:
            if lay.pp_rank == stage:
                _send_unit(hf, pp_ranks[0])
                hf = {}
            elif first:
                hf = _recv_unit(cfg, unit, pp_ranks[stage])
        yield hf if first else {}
