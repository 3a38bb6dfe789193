"""Where each rank runs: its node, its GPUs, its CPU cores and thread count. Decided in one place.

`place_rank` is pure: it takes the run plan and the `ProcessEnv` (the one reader of the environment,
cluster/env.py) and returns a `Placement`; the worker entry calls it once per rank and then
`apply_placement` (affinity, CUDA_VISIBLE_DEVICES, torch.cuda.set_device, thread counts). The dry runs of
`launch.py run|submit` call the same function with the node layout the job will have (`predict`).

Layout rule (srun's and mpiexec's default block distribution): the ranks of one node are consecutive
world ranks, and `rank - local_rank` is the first of them. A rank's GPU slot on its node is the number of
GPUs the ranks before it on that node take (`roles.<role>.gpus_per_rank`), so the ranks of a node get
disjoint GPUs: the ids at [slot, slot + gpus) of the GPUs the step made visible (CUDA_VISIBLE_DEVICES, else
SLURM_STEP_GPUS; locally every GPU of the machine). When SLURM bound exactly the rank's own GPUs to the
task (`--gpu-bind`), those are used as they are. A rank then sees only its own GPUs (CUDA_VISIBLE_DEVICES
is narrowed, so engines that start their own processes, such as vLLM, stay on them) and uses cuda:0.
Ranks with no GPUs see none and stay on CPU.

CPU cores: SLURM gives each task `--cpus-per-task` cores (its task plugin binds them where configured),
so under SLURM only the thread counts are set. Locally a rank with `cpus_per_rank = c` is pinned to c
cores of the launcher's affinity mask from its core slot on (the same prefix rule as GPUs), wrapping
around when the machine has fewer cores than the ranks ask for: every rank runs, oversubscribed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from rollart_hpc.cluster.env import ProcessEnv
from rollart_hpc.cluster.plan import RunPlan
from rollart_hpc.config.schema import RoleConfig


class PlacementError(RuntimeError):
    """A rank cannot get the GPUs its role asks for on its node."""


@dataclass(frozen=True)
class Placement:
    """One rank's node, GPUs (ids as the launcher numbers them on the node), cores and threads."""

    rank: int
    role: str
    node: str
    local_rank: int
    gpu_ids: tuple[str, ...]
    cpus: tuple[int, ...]
    threads: int

    @property
    def device(self) -> str:
        """The torch device of the rank once its GPUs are the only visible ones."""
        return "cuda:0" if self.gpu_ids else "cpu"

    def describe(self) -> str:
        gpus = f"GPU {','.join(self.gpu_ids)} -> {self.device}" if self.gpu_ids else "cpu"
        cores = f"  cores {compact(self.cpus)}" if self.cpus else ""
        threads = f"  threads {self.threads}" if self.threads else ""
        return (
            f"rank {self.rank:<3} {self.role:<10} node {self.node:<14} local {self.local_rank:<3} "
            f"{gpus}{cores}{threads}"
        )


def compact(values: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def slot_before(plan: RunPlan, rank: int, local_rank: int, amount: Callable[[RoleConfig], int]) -> int:
    """What the ranks before `rank` on its node take (ranks rank - local_rank .. rank - 1)."""
    if not 0 <= local_rank <= rank:
        raise PlacementError(f"{plan.describe(rank)}: local rank {local_rank} does not fit a block layout")
    return sum(amount(plan.role_of(r).resources) for r in range(rank - local_rank, rank))


def choose_gpus(
    plan: RunPlan,
    rank: int,
    local_rank: int,
    visible: Sequence[str],
    bound_to_task: bool,
    share: bool = False,
) -> tuple[str, ...]:
    """The GPU ids of `visible` that `rank` uses; () for a rank whose role has no GPUs. With `share`
    (`cluster.share_gpus`), slots past the node's last GPU wrap around to its first."""
    need = plan.role_of(rank).resources.gpus_per_rank
    if not need:
        return ()
    if bound_to_task and len(visible) == need:
        return tuple(visible)
    slot = slot_before(plan, rank, local_rank, lambda c: c.gpus_per_rank)
    if share and need <= len(visible):
        return tuple(visible[(slot + i) % len(visible)] for i in range(need))
    if slot + need > len(visible):
        raise PlacementError(
            f"{plan.describe(rank)} (local rank {local_rank}) needs GPUs {slot}-{slot + need - 1} of its node, "
            f"but {len(visible)} are visible ({','.join(visible) or 'none'})"
        )
    return tuple(visible[slot : slot + need])


def choose_cpus(plan: RunPlan, rank: int, local_rank: int, available: Sequence[int]) -> tuple[int, ...]:
    """Cores to pin `rank` to (locally): its share of `available`, wrapping around when short."""
    need = plan.role_of(rank).resources.cpus_per_rank
    if not need or not available:
        return ()
    slot = slot_before(plan, rank, local_rank, lambda c: c.cpus_per_rank)
    return tuple(sorted({available[(slot + i) % len(available)] for i in range(need)}))


def place_rank(
    plan: RunPlan,
    rank: int,
    env: ProcessEnv,
    machine_gpus: int,
    machine_cpus: Sequence[int],
    share_gpus: bool = False,
) -> Placement:
    """Where `rank` runs. `machine_gpus` counts the GPUs when the environment names none; `machine_cpus`
    is the launcher's affinity mask (used only outside SLURM); `share_gpus` is `cluster.share_gpus`."""
    local = env.local_rank if env.local_rank is not None else rank
    visible = env.visible_gpus
    if visible is None:
        visible = tuple(str(i) for i in range(machine_gpus))
    gpus = choose_gpus(plan, rank, local, visible, bound_to_task=env.under_slurm, share=share_gpus)
    cpus = () if env.under_slurm else choose_cpus(plan, rank, local, machine_cpus)
    threads = plan.role_of(rank).resources.cpus_per_rank
    return Placement(rank, plan.role_of(rank).role, env.node_name, local, gpus, cpus, threads)


def predict(plan: RunPlan, node_of: Callable[[int], tuple[str, int]], cpus: Sequence[int]) -> list[Placement]:
    """Every rank's placement for a layout `rank -> (node, local rank)`, with the node's GPUs numbered
    0, 1, ... as SLURM and CUDA number them (what the dry runs print)."""
    total_gpus = sum(r.num_ranks * r.resources.gpus_per_rank for r in plan.roles)
    out = []
    for rank in range(plan.world_size):
        node, local = node_of(rank)
        env = ProcessEnv(None, None, local, node, None, None, 0, None, None)
        out.append(place_rank(plan, rank, env, total_gpus, cpus))
    return out


def predict_local(plan: RunPlan) -> list[Placement]:
    """Placements of a local run (`launch.py run`): one node, local rank = world rank."""
    placements = predict(plan, lambda rank: ("localhost", rank), sorted(os.sched_getaffinity(0)))
    check_distinct(placements)
    return placements


def check_distinct(placements: Sequence[Placement]) -> None:
    """PlacementError if two ranks of one node would share a GPU."""
    owner: dict[tuple[str, str], int] = {}
    for p in placements:
        for gpu in p.gpu_ids:
            other = owner.setdefault((p.node, gpu), p.rank)
            if other != p.rank:
                raise PlacementError(f"ranks {other} and {p.rank} would share GPU {gpu} of node {p.node}")


def placement_table(placements: Sequence[Placement]) -> str:
    return "\n".join(
        ["placement (rank, role, node, local rank, device):", *(f"  {p.describe()}" for p in placements)]
    )


def group_backend(
    requested: str, plan: RunPlan, members: Sequence[int], cuda_available: bool, share_gpus: bool = False
) -> Literal["gloo", "nccl"]:
    """Backend of a torch.distributed group: 'auto' is NCCL when every member has GPUs and CUDA works,
    and not with `cluster.share_gpus` (NCCL cannot put two ranks of a group on one device)."""
    if requested in ("gloo", "nccl"):
        return "nccl" if requested == "nccl" else "gloo"
    on_gpu = all(plan.role_of(m).resources.gpus_per_rank > 0 for m in members)
    return "nccl" if cuda_available and on_gpu and members and not share_gpus else "gloo"


def apply_placement(placement: Placement, require_cuda: bool) -> str:
    """Make this process run where `placement` says; returns the torch device it uses ('cpu' or 'cuda:0').

    Call before CUDA is initialised in this process (the worker entry does, first thing)."""
    if placement.cpus:
        os.sched_setaffinity(0, placement.cpus)
    if placement.threads:
        os.environ["OMP_NUM_THREADS"] = str(placement.threads)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(placement.gpu_ids)
    if placement.threads or placement.gpu_ids:
        import torch

        if placement.threads:
            torch.set_num_threads(placement.threads)
        if placement.gpu_ids:
            return _set_cuda_device(placement, require_cuda)
    return "cpu"


def _set_cuda_device(placement: Placement, require_cuda: bool) -> str:
    import torch

    if torch.cuda.is_available():
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # NCCL collectives honour timeouts
        torch.cuda.set_device(0)
        return "cuda:0"
    message = f"rank {placement.rank} ({placement.role}) was given GPU {','.join(placement.gpu_ids)} but torch sees no CUDA device"
    if require_cuda:
        raise PlacementError(f"{message} (cluster.require_cuda = false runs it on CPU)")
    print(
        f"[placement] warning: {message}; running on CPU (cluster.require_cuda = false)",
        file=sys.stderr,
        flush=True,
    )
    return "cpu"
