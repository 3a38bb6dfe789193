"""Placement of ranks (cluster/placement.py): devices from the plan and fake environments, no GPU needed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollart_hpc.cluster.env import read_process_env
from rollart_hpc.cluster.placement import (
    Placement,
    PlacementError,
    apply_placement,
    check_distinct,
    compact,
    group_backend,
    place_rank,
    predict,
    predict_local,
)
from rollart_hpc.cluster.plan import make_plan
from rollart_hpc.cluster.sbatch import component_layout, het_components
from rollart_hpc.config import load_config
from rollart_hpc.config.loader import build
from rollart_hpc.config.schema import RolesConfig

REPO = Path(__file__).resolve().parent.parent


def _plan(**roles: dict[str, object]):
    return make_plan(build(RolesConfig, roles))


GPU_NODE = _plan(
    rollout={"num_ranks": 2, "gpus_per_rank": 2, "cpus_per_rank": 2},
    env={"num_ranks": 1, "cpus_per_rank": 3},
    trainer={"num_ranks": 3, "gpus_per_rank": 1, "cpus_per_rank": 1},
)  # ranks: 0 controller, 1-2 rollout, 3 env, 4 reward, 5-7 trainer


def _slurm_env(rank: int, local: int, gpus: str | None, node: str = "n1") -> dict[str, str]:
    env = {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local),
        "SLURM_JOB_ID": "9",
        "SLURMD_NODENAME": node,
    }
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def test_ranks_of_a_node_get_disjoint_gpus_from_what_the_step_gave() -> None:
    visible = "4,5,6,7,0,1,2,3"
    got = {
        rank: place_rank(GPU_NODE, rank, read_process_env(_slurm_env(rank, rank, visible)), 0, []).gpu_ids
        for rank in range(8)
    }
    assert got == {
        0: (),
        1: ("4", "5"),
        2: ("6", "7"),
        3: (),
        4: (),
        5: ("0",),
        6: ("1",),
        7: ("2",),
    }


def test_local_rank_counts_from_the_first_rank_of_the_node() -> None:
    # trainers 5-7 on a node of their own (a hetjob component): local ranks 0-2 take GPUs 0-2
    plan = GPU_NODE
    for rank, local in ((5, 0), (6, 1), (7, 2)):
        placement = place_rank(
            plan, rank, read_process_env(_slurm_env(rank, local, "0,1,2,3", "train7")), 0, []
        )
        assert (
            placement.gpu_ids == (str(local),) and placement.device == "cuda:0" and placement.node == "train7"
        )


def test_gpus_bound_per_task_by_slurm_are_used_as_they_are() -> None:
    placement = place_rank(GPU_NODE, 6, read_process_env(_slurm_env(6, 1, "3")), 0, [])
    assert placement.gpu_ids == ("3",)


def test_step_gpus_are_read_when_cuda_visible_devices_is_unset() -> None:
    env = {**_slurm_env(5, 0, None), "SLURM_STEP_GPUS": "2,3"}
    assert place_rank(GPU_NODE, 5, read_process_env(env), 0, []).gpu_ids == ("2",)


def test_too_few_gpus_is_an_error_naming_the_rank() -> None:
    with pytest.raises(
        PlacementError, match=r"trainer rank 7 .*needs GPUs 6-6 of its node, but 2 are visible"
    ):
        place_rank(GPU_NODE, 7, read_process_env(_slurm_env(7, 7, "0,1")), 0, [])


def test_local_run_uses_the_machines_gpus_and_pins_cores_with_wraparound() -> None:
    env = read_process_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "3"})
    placement = place_rank(GPU_NODE, 3, env, 8, [0, 1])
    assert placement.gpu_ids == () and placement.threads == 3
    assert placement.cpus == (
        0,
        1,
    )  # 3 cores wanted from slot 4 on a 2-core machine: every core, oversubscribed
    trainer = place_rank(
        GPU_NODE, 5, read_process_env({"OMPI_COMM_WORLD_LOCAL_RANK": "5"}), 8, list(range(16))
    )
    assert trainer.gpu_ids == ("4",) and trainer.cpus == (7,)


def test_slurm_ranks_keep_the_affinity_slurm_gave_and_get_thread_counts() -> None:
    placement = place_rank(
        GPU_NODE, 3, read_process_env(_slurm_env(3, 3, "0,1,2,3,4,5,6,7")), 0, [0, 1, 2, 3]
    )
    assert placement.cpus == () and placement.threads == 3


def test_cpu_defaults_change_nothing() -> None:
    plan = make_plan(load_config(REPO / "configs" / "local.toml").roles)
    for placement in predict_local(plan):
        assert (placement.gpu_ids, placement.cpus, placement.threads, placement.device) == ((), (), 0, "cpu")


def test_predicted_placement_of_the_two_partition_config_gives_each_rank_its_own_gpu() -> None:
    plan = make_plan(load_config(REPO / "configs" / "gpu_2partitions.toml").roles)
    placements = predict(plan, component_layout(het_components(plan)), ())
    check_distinct(placements)
    assert len(placements) == plan.world_size
    on_gpu = [p for p in placements if p.gpu_ids]
    assert {p.role for p in on_gpu} == {"rollout", "trainer"} and all(p.device == "cuda:0" for p in on_gpu)
    assert {(p.node, p.gpu_ids) for p in on_gpu if p.role == "trainer"} == {
        (f"train:c1n{n}", (str(g),)) for n in range(2) for g in range(8)
    }


def test_check_distinct_refuses_a_shared_gpu() -> None:
    a = Placement(0, "trainer", "n", 0, ("1",), (), 0)
    b = Placement(1, "rollout", "n", 1, ("1",), (), 0)
    with pytest.raises(PlacementError, match="ranks 0 and 1 would share GPU 1 of node n"):
        check_distinct([a, b])
    check_distinct([a, Placement(1, "rollout", "m", 0, ("1",), (), 0)])


def test_nccl_only_when_every_member_has_a_gpu_and_cuda_works() -> None:
    assert group_backend("auto", GPU_NODE, [5, 6, 7], cuda_available=True) == "nccl"
    assert group_backend("auto", GPU_NODE, [5, 1, 2], cuda_available=True) == "nccl"
    assert group_backend("auto", GPU_NODE, [5, 3], cuda_available=True) == "gloo"
    assert group_backend("auto", GPU_NODE, [5, 6, 7], cuda_available=False) == "gloo"
    assert group_backend("gloo", GPU_NODE, [5, 6], cuda_available=True) == "gloo"


def test_apply_placement_on_cpu_sets_affinity_threads_and_hides_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    before = os.sched_getaffinity(0)
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    core = min(before)
    try:
        assert apply_placement(Placement(0, "env", "n", 0, (), (core,), 1), require_cuda=True) == "cpu"
        assert os.sched_getaffinity(0) == {core} and os.environ["CUDA_VISIBLE_DEVICES"] == ""
        assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def test_a_gpu_rank_without_cuda_fails_unless_told_to_run_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    placement = Placement(5, "trainer", "n", 0, ("1",), (), 0)
    with pytest.raises(PlacementError, match="was given GPU 1 but torch sees no CUDA device"):
        apply_placement(placement, require_cuda=True)
    assert apply_placement(placement, require_cuda=False) == "cpu"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_compact() -> None:
    assert compact([5, 0, 1, 2]) == "0-2,5" and compact([]) == ""


def test_shared_gpus_wrap_around_only_when_the_config_says_so() -> None:
    env = read_process_env({"OMPI_COMM_WORLD_LOCAL_RANK": "6", "CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(PlacementError, match="needs GPUs 5-5"):
        place_rank(GPU_NODE, 6, env, 0, [])
    assert place_rank(GPU_NODE, 6, env, 0, [], share_gpus=True).gpu_ids == ("0",)


def test_shared_gpus_keep_groups_on_gloo() -> None:
    assert group_backend("auto", GPU_NODE, [5, 1], cuda_available=True, share_gpus=True) == "gloo"
