"""`launch.py envs ...`: prepare the household games, check oracles, play a task at the terminal.

- `envs prepare [--force] [--procs N]`: generate and cache the 128 household games (and the 16 held-out ones) under the data dir.
- `envs check FAMILY [--all]`: play the oracle of each task (a fixed sample without `--all`) through
  the env interface and print `solved N/M`; exit 1 unless every task is solved.
- `envs play FAMILY TASK_ID`: play one task, one command per stdin line.
"""

from __future__ import annotations

import argparse
import sys
import time

from rollart_hpc.contracts.errors import UsageError

SAMPLE_SIZE = 12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="envs_command", required=True, metavar="SUBCOMMAND")
    prep = sub.add_parser("prepare", help="generate and cache the household games")
    prep.add_argument("--force", action="store_true", help="regenerate even if a cache exists")
    prep.add_argument("--procs", type=int, default=2, help="generator processes (default 2)")
    check = sub.add_parser("check", help="solve tasks with the oracle and print solved N/M")
    check.add_argument("family", help="env family: household, calc_math or frozenlake")
    check.add_argument("--all", action="store_true", help="every task instead of a fixed sample")
    play = sub.add_parser("play", help="play one task at the terminal (one command per line)")
    play.add_argument("family")
    play.add_argument("task_id", help="e.g. household/000, calc_math/0042, frozenlake/4x4")


def main(args: argparse.Namespace) -> int:
    if args.envs_command == "prepare":
        return _prepare(args.force, args.procs)
    if args.envs_command == "check":
        return _check(args.family, args.all)
    return _play(args.family, args.task_id)


def _family(name: str):  # type: ignore[no-untyped-def]
    from rollart_hpc.envs.families.household_data import is_ready
    from rollart_hpc.envs.registry import FAMILIES, make_family

    if name not in FAMILIES:
        raise UsageError(f"unknown env family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    if name == "household" and not is_ready():
        raise UsageError("household games are not prepared: run `launch.py envs prepare`")
    return make_family(name)


def _prepare(force: bool, procs: int) -> int:
    from rollart_hpc.envs.families.household_data import prepare

    if procs < 1:
        raise UsageError(f"--procs must be >= 1, got {procs}")
    prepare(num_procs=procs, force=force)
    return 0


def sample(ids: list[str], size: int = SAMPLE_SIZE) -> list[str]:
    """A fixed, evenly spaced sample of `ids`."""
    if len(ids) <= size:
        return list(ids)
    return [ids[round(k * (len(ids) - 1) / (size - 1))] for k in range(size)]


def _check(name: str, every: bool) -> int:
    from rollart_hpc.envs.demos import run_oracle

    family = _family(name)
    ids = [t.id for t in family.tasks()]
    chosen = ids if every else sample(ids)
    started = time.monotonic()
    env = family.make_env()
    try:
        results = [run_oracle(family, tid, env) for tid in chosen]
    finally:
        env.close()
    for r in results:
        if not r.won:
            print(f"unsolved {r.task_id} after {r.steps} steps {r.detail}".rstrip())
    solved = sum(r.won for r in results)
    print(f"solved {solved}/{len(results)} ({time.monotonic() - started:.1f} s)")
    return 0 if solved == len(results) else 1


def _play(name: str, tid: str) -> int:
    family = _family(name)
    try:
        task = family.task(tid)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    env = family.make_env()
    try:
        print(f"[{task.id}] {task.system}\n{env.reset(tid)}")
        for turn in range(task.max_turns):
            line = sys.stdin.readline()
            if not line:
                print("(end of input)")
                return 0
            obs, reward, done, info = env.step(line.rstrip("\n"))
            print(f"{obs}\n[turn {turn + 1}/{task.max_turns} reward {reward:g}]")
            if done:
                print("won" if info.get("won") else "lost")
                return 0
        print("turn limit reached")
        return 0
    finally:
        env.close()
