import pytest

from rollart_hpc.cluster.env import read_process_env
from rollart_hpc.cluster.plan import make_plan
from rollart_hpc.config.loader import build
from rollart_hpc.config.schema import RolesConfig


def roles(**counts):
    return build(RolesConfig, {name: {"num_ranks": n} for name, n in counts.items()})


def test_plan_assigns_contiguous_ranges_in_role_order():
    plan = make_plan(roles(rollout=2, env=3, reward=0, trainer=2))
    assert plan.world_size == 8
    assert list(plan.ranks_of("controller")) == [0]
    assert list(plan.ranks_of("rollout")) == [1, 2]
    assert list(plan.ranks_of("env")) == [3, 4, 5]
    assert list(plan.ranks_of("reward")) == []
    assert list(plan.ranks_of("trainer")) == [6, 7]
    assert [plan.role_of(r).role for r in range(8)] == ["controller"] + ["rollout"] * 2 + ["env"] * 3 + [
        "trainer"
    ] * 2
    assert plan.describe(4) == "env rank 4 (env #1)"


def test_plan_rejects_outside_rank():
    plan = make_plan(roles())
    with pytest.raises(ValueError, match="outside the world of 5 ranks"):
        plan.role_of(5)


def test_plan_carries_partitions():
    cfg = build(RolesConfig, {"rollout": {"partition": "rollout"}, "trainer": {"partition": "train"}})
    plan = make_plan(cfg)
    assert plan.range_of("trainer").partition == "train"
    assert "partition=train" in plan.table()


def test_process_env_reads_launchers():
    env = read_process_env(
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    )
    assert (env.launcher_rank, env.launcher_size, env.local_rank, env.under_slurm) == (3, 5, 1, False)
    slurm = read_process_env(
        {
            "SLURM_PROCID": "2",
            "SLURM_NTASKS": "4",
            "SLURM_JOB_ID": "17",
            "SLURMD_NODENAME": "train1",
            "SLURM_RESTART_COUNT": "1",
            "SLURM_HET_JOB_ID_SET_INDEX": "1",
        }
    )
    assert (slurm.launcher_rank, slurm.node_name, slurm.slurm_restart_count, slurm.slurm_het_group) == (
        2,
        "train1",
        1,
        1,
    )
    assert slurm.under_slurm
