"""Run under mpiexec by tests/test_world_mpi.py: python world_check.py MODE NUM_ENV TIMEOUT OUT_DIR."""

import json
import sys
from pathlib import Path

from rollart_hpc.cluster.env import read_process_env
from rollart_hpc.cluster.plan import make_plan
from rollart_hpc.cluster.world import make_world
from rollart_hpc.config.loader import build
from rollart_hpc.config.schema import RolesConfig
from rollart_hpc.contracts.errors import PeerTimeoutError


def main() -> None:
    mode, num_env, timeout, out_dir = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4])
    roles = build(RolesConfig, {"env": {"num_ranks": num_env}, "reward": {"num_ranks": 0}})
    world = make_world(make_plan(roles), read_process_env(), timeout)
    result: dict = {"rank": world.rank, "role": world.role, "role_size": world.role_comm.Get_size()}
    if mode == "p2p":
        # controller asks every rank for its role; each answers over MPI point-to-point
        if world.rank == 0:
            result["answers"] = {}
            for peer in range(1, world.plan.world_size):
                world.send("who", peer, tag=5)
                result["answers"][peer] = world.recv(peer, tag=6)
        else:
            assert world.recv(0, tag=5) == "who"
            world.send(world.role, 0, tag=6)
        world.barrier()
    elif mode == "torch":
        import torch

        from rollart_hpc.cluster.torchdist import destroy_torch_groups, init_torch_groups

        groups = init_torch_groups(world, "gloo")
        if world.role in ("trainer", "rollout"):
            src = world.plan.ranks_of("trainer")[0]
            t = torch.full((1000,), 3.5) if world.rank == src else torch.zeros(1000)
            groups.broadcast(t, src, groups.weights, groups.weights_ranks)
            result["sum"] = float(t.sum())
        env_ranks = list(world.plan.ranks_of("env"))
        if world.role == "env":
            t = torch.tensor([float(world.rank)])
            groups.all_reduce(t, groups.by_role["env"], env_ranks)
            result["env_sum"] = float(t.item())
        world.barrier()  # rank 0 serves the store: it leaves last
        destroy_torch_groups()
    elif mode == "silent":
        silent = world.plan.ranks_of("env")[0]
        if world.rank == 0:
            try:
                world.recv(silent, tag=7)
            except PeerTimeoutError as exc:
                result["error"] = str(exc)
        elif world.rank == silent:
            pass  # never sends
    (out_dir / f"rank-{world.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
