"""Load, override, validate and resolve a config once; write what every role reads to the run dir.

Cross-role invariants live here and nowhere else. Roles read `config.resolved.toml` (and their own
`role-<name>.toml`) and never re-derive values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import tomli_w

from rollart_hpc.config.loader import apply_overrides, build, load_toml, to_dict
from rollart_hpc.config.schema import ROLE_NAMES, Config
from rollart_hpc.contracts.atomic import atomic_write_bytes
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout

RESOLVED_NAME = RunLayout.CONFIG_NAME
RL_SECTIONS = ("model", "rollout", "envs", "reward", "algo", "trainer", "controller", "routing")


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a TOML file, apply dotted overrides, build and validate the typed tree; relative file paths
    of the run's own code and data (run.python_path, envs.datasets[].path) become absolute, taken from
    the config file's directory."""
    data = apply_overrides(load_toml(Path(path)), overrides)
    config = anchor_paths(build(Config, data), Path(path).resolve().parent)
    check_invariants(config)
    return config


def anchor_paths(config: Config, base: Path) -> Config:
    """`config` with run.python_path and envs.datasets[].path made absolute against `base`."""
    python_path = [str((base / p).resolve()) for p in config.run.python_path]
    datasets = [dataclasses.replace(d, path=str((base / d.path).resolve())) for d in config.envs.datasets]
    return dataclasses.replace(
        config,
        run=dataclasses.replace(config.run, python_path=python_path),
        envs=dataclasses.replace(config.envs, datasets=datasets),
    )


def check_invariants(config: Config) -> None:
    """Invariants that span sections; every one raises a UsageError naming the fields."""
    world = world_size(config)
    smoke = config.smoke
    for name in ("fail_rank", "silent_rank"):
        rank = getattr(smoke, name)
        if rank >= world:
            raise UsageError(f"smoke.{name}: rank {rank} is outside the world of {world} ranks")
    if config.run.job != "smoke" and smoke != type(smoke)():
        raise UsageError(f"smoke: options set but run.job is {config.run.job!r}; remove them")
    if config.run.job == "smoke":
        for name in RL_SECTIONS:
            if getattr(config, name) != type(getattr(config, name))():
                raise UsageError(f"{name}: options set but run.job is 'smoke'; remove them")
    if config.run.job == "rl":
        config.reward.check_num_ranks(config.roles.reward.num_ranks)
    check_role_resources(config)


def check_role_resources(config: Config) -> None:
    """Thread counts fit the cores a rank gets; a vLLM engine's tensor parallel group fits its GPUs."""
    for section in ("rollout", "trainer"):
        threads, cpus = getattr(config, section).num_threads, getattr(config.roles, section).cpus_per_rank
        if cpus and threads > cpus:
            raise UsageError(
                f"{section}.num_threads: {threads} threads exceed roles.{section}.cpus_per_rank = {cpus}"
            )
    check_pool_resources(config)


def check_pool_resources(config: Config) -> None:
    """Each rollout pool's threads fit its cores, its vLLM tensor parallel group its GPUs; a cost profile
    needs the built-in engine."""
    tp = config.rollout.tensor_parallel_size
    for index, pool in enumerate(config.roles.rollout_pools):
        path = f"roles.rollout_pools[{index}]"
        threads = pool.num_threads or config.rollout.num_threads
        if pool.cpus_per_rank and threads > pool.cpus_per_rank:
            raise UsageError(
                f"{path}.num_threads: {threads} threads exceed its cpus_per_rank = {pool.cpus_per_rank}"
            )
        if pool.gpus_per_rank and tp > pool.gpus_per_rank:
            raise UsageError(f"rollout.tensor_parallel_size: {tp} needs {path}.gpus_per_rank >= {tp}")
        if pool.has_cost_profile and config.rollout.engine != "builtin":
            raise UsageError(f"{path}.prefill_cost_scale: cost profiles need rollout.engine = 'builtin'")
    gpus = config.roles.rollout.gpus_per_rank
    if gpus and tp > gpus:
        raise UsageError(
            f"rollout.tensor_parallel_size: {tp} needs roles.rollout.gpus_per_rank >= {tp}, got {gpus}"
        )


def world_size(config: Config) -> int:
    return sum(getattr(config.roles, name).num_ranks for name in ROLE_NAMES)


def write_resolved(config: Config, run_dir: Path) -> Path:
    """Write config.resolved.toml and one role-<name>.toml per role into `run_dir` (atomically)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tree = to_dict(config)
    target = run_dir / RESOLVED_NAME
    atomic_write_bytes(target, tomli_w.dumps(tree).encode())
    for name in ROLE_NAMES:
        role = {"role": name, **to_dict(getattr(config.roles, name)), "cluster": tree["cluster"]}
        atomic_write_bytes(run_dir / f"role-{name}.toml", tomli_w.dumps(role).encode())
    return target


def read_resolved(run_dir: Path) -> Config:
    """What a rank reads: the resolved tree, validated again (the file may have been edited)."""
    return load_config(run_dir / RESOLVED_NAME)
