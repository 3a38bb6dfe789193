"""`launch.py plan CONFIG [key=value ...] [--memory [--json OUT]]`: the run plan of a config, resolved as for
`run`: every rank's role (and, with `--memory`, the GPU memory it needs, `rollart_hpc.plan.ranks`). A memory
plan that cannot fit is a usage error (exit 2) naming the rank, its total, its limit and its biggest term.

`--resources --gpus N [--hardware h800:64,h20:24] [--model CONFIG_JSON] [--calibrate RUN_DIR] [--write OUT]`:
the split of N GPUs among the trainer and the rollout pools, the trainer's layout and the staleness bound,
searched by simulating the config's workload (`rollart_hpc.sim.resources`); prints the best few and writes
the best as a config that `plan --memory` accepts.

`--resources --ranks N --calibrate RUN_DIR [--write OUT]`: on CPU ranks instead of GPUs, the split of N ranks
among rollout, env and trainer (the controller and reward ranks on top), each simulated with the costs and
episodes of the measured run (`rollart_hpc.sim.resources.search_ranks`); prints the best few and the config's
own split, and writes the best as a config."""

from __future__ import annotations

import argparse

from rollart_hpc.entry.options import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "dotted overrides, e.g. trainer.tensor_parallel=2")
    parser.add_argument(
        "--memory", action="store_true", help="every rank's GPU memory by term; exit 2 when a rank cannot fit"
    )
    parser.add_argument("--json", metavar="OUT", help="with --memory: write the memory plan as JSON to OUT")
    parser.add_argument("--resources", action="store_true", help="search the GPU split (needs --gpus)")
    parser.add_argument("--gpus", type=int, default=0, help="with --resources: GPUs to split")
    parser.add_argument(
        "--ranks",
        type=int,
        default=0,
        help="with --resources --calibrate: CPU ranks to split instead of GPUs",
    )
    parser.add_argument(
        "--hardware", default="", help="with --resources: GPU types and counts, h800:64,h20:24"
    )
    parser.add_argument(
        "--model", default="", help="with --resources: the model's config.json (default: the config's)"
    )
    parser.add_argument(
        "--calibrate", default="", help="with --resources: take the workload from this measured run"
    )
    parser.add_argument(
        "--write", metavar="CONFIG_OUT", default="", help="with --resources: write the best split"
    )
    parser.add_argument("--top", type=int, default=5, help="with --resources: splits to print (default 5)")


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.config import load_config
    from rollart_hpc.contracts.errors import UsageError
    from rollart_hpc.plan.ranks import memory_plan

    if args.json and not args.memory:
        raise UsageError("--json writes the memory plan: add --memory")
    if args.resources:
        return resources(args)
    if args.write or args.gpus or args.hardware or args.ranks:
        raise UsageError("--gpus, --ranks, --hardware and --write belong to --resources")
    config = load_config(args.config, args.overrides)
    print(make_plan(config.roles).table())
    if args.memory:
        memory = memory_plan(config)
        print(memory.table())
        if args.json:
            memory.write_json(args.json)
        memory.check()
    return 0


SHIPPED_MODEL = "configs/models/qwen2.5-7b"


def resources(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rollart_hpc.config import load_config
    from rollart_hpc.config.loader import apply_overrides, load_toml
    from rollart_hpc.contracts.errors import UsageError
    from rollart_hpc.plan.gpus import gpu_spec
    from rollart_hpc.sim.hardware import parse_hardware, read_model
    from rollart_hpc.sim.resources import search, write
    from rollart_hpc.sim.workload import Workload, sample

    if args.memory:
        raise UsageError(
            "--resources and --memory are separate: plan the split, then --memory on --write's config"
        )
    if args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")
    if args.ranks:
        return cpu_ranks(args)
    config = load_config(args.config, args.overrides)
    if args.hardware:
        gpus = parse_hardware(args.hardware)
        if all(n == 0 for _, n in gpus) and len(gpus) == 1:
            gpus = [(gpus[0][0], args.gpus)]
        if any(n == 0 for _, n in gpus):
            raise UsageError(
                f"--hardware: give every type a count, e.g. h800:64,h20:24; got {args.hardware!r}"
            )
    else:
        types = {p.gpu_type.lower() for p in config.roles.pools() if p.gpu_type}
        if len(types) != 1:
            raise UsageError(
                "--resources: the config's pools name no single gpu_type; give --hardware TYPE:N,..."
            )
        gpus = [(gpu_spec(types.pop()), args.gpus)]
    total = sum(n for _, n in gpus)
    if args.gpus and args.gpus != total:
        raise UsageError(f"--gpus {args.gpus} but --hardware sums to {total}")
    if total < 2:
        raise UsageError(f"--resources: needs --gpus N >= 2, got {total}")
    tree = apply_overrides(load_toml(Path(args.config)), args.overrides)
    model_dir = args.model or config.model.path
    if not args.model and not (Path(model_dir) / "config.json").is_file():
        print(
            f"model: {model_dir} has no config.json here; using {SHIPPED_MODEL}'s shape (written as model.path)"
        )
        model_dir = SHIPPED_MODEL
    model = read_model(model_dir)
    if model_dir != config.model.path:  # --model or the fallback: the written config points at it
        model_path = str(Path(model_dir).parent if Path(model_dir).is_file() else Path(model_dir))
        tree.setdefault("model", {}).update(source="path", path=model_path)
    if args.calibrate:
        from rollart_hpc.entry.simulate import _run_config
        from rollart_hpc.sim.profile import calibrate

        run_dir = Path(args.calibrate).resolve()
        episodes = calibrate(run_dir, _run_config(run_dir).roles.rollout.num_ranks)[0].episodes
        print(f"workload: {len(episodes)} episodes measured in {run_dir}")
    else:
        episodes = sample(Workload(), 4 * config.controller.batch_size * 8)
        print("workload: the default mix (rollart_hpc/sim/workload.py)")
    splits, failures = search(tree, gpus, model, episodes)
    for failure in failures:
        print(f"not ranked, the controller core's invariant failed in simulation: {failure}")
    print(f"best {min(args.top, len(splits))} of {len(splits)} splits of {total} GPUs, by trajectories/s:")
    for i, split in enumerate(splits[: args.top], 1):
        print(f"{i}. {split.describe()}")
    spread = splits[0].trajectories_per_s / max(splits[-1].trajectories_per_s, 1e-12) - 1
    if spread < 0.05:
        print(
            f"every split is within {spread:.1%} of the best: throughput is bound outside the GPUs "
            "(env slots, env latency or the batch), not by the split"
        )
    if args.write:
        write(tree, splits[0], args.write)
        print(f"wrote {args.write} (split 1); check it with: launch.py plan {args.write} --memory")
    return 0


def cpu_ranks(args: argparse.Namespace) -> int:
    from pathlib import Path

    import tomli_w

    from rollart_hpc.config import load_config
    from rollart_hpc.config.loader import apply_overrides, load_toml
    from rollart_hpc.contracts.errors import UsageError
    from rollart_hpc.entry.simulate import _run_config
    from rollart_hpc.sim.model import Scenario, refine
    from rollart_hpc.sim.profile import calibrate
    from rollart_hpc.sim.resources import RankSplit, rank_tree, search_ranks, simulate_ranks

    if args.gpus or args.hardware or args.model:
        raise UsageError("--ranks splits CPU ranks: --gpus, --hardware and --model do not apply")
    if not args.calibrate:
        raise UsageError("--ranks needs --calibrate RUN_DIR (the measured run whose costs it simulates)")
    if args.ranks < 3:
        raise UsageError(f"--ranks: needs N >= 3 (one rollout, env and trainer rank), got {args.ranks}")
    config = load_config(args.config, args.overrides)
    tree = apply_overrides(load_toml(Path(args.config)), args.overrides)
    run_dir = Path(args.calibrate).resolve()
    run_config = _run_config(run_dir)
    profile, _ = calibrate(run_dir, run_config.roles.rollout.num_ranks)
    profile = refine(profile, Scenario(run_config))
    trainers = run_config.roles.trainer.num_ranks
    print(f"workload and costs: measured in {run_dir} ({trainers} trainer rank(s))")
    splits = search_ranks(tree, args.ranks, profile, trainers)
    print(
        f"best {min(args.top, len(splits))} of {len(splits)} splits of {args.ranks} ranks, by trajectories/s:"
    )
    for i, split in enumerate(splits[: args.top], 1):
        print(f"{i}. {split.describe()}")
    roles = config.roles
    own = RankSplit(roles.rollout.num_ranks, roles.env.num_ranks, roles.trainer.num_ranks)
    mine = simulate_ranks(tree, own, profile, trainers)
    print(f"the config's split: {mine.describe()}")
    print(
        f"best over the config's split: {splits[0].trajectories_per_s / mine.trajectories_per_s:.2f}x traj/s"
    )
    if args.write:
        tree = rank_tree(tree, splits[0])
        Path(args.write).write_text(tomli_w.dumps(tree))
        print(f"wrote {args.write} (split 1)")
    return 0
