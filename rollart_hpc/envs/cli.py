"""`launch.py envs ...`: prepare the household games, check oracles, play a task at the terminal.

- `envs prepare [--force] [--procs N]`: generate and cache the 128 household games (and the 16 held-out ones) under the data dir.
- `envs check FAMILY [--all]`: play the oracle of each task (a fixed sample without `--all`) through
  the env interface and print `solved N/M`; exit 1 unless every task is solved.
- `envs play FAMILY TASK_ID`: play one task, one command per stdin line.
- `envs baseline [--policies random,explorer] [--slack 4,8] [--episodes N] [--types T,..] [--seed S]
  [--json OUT]`: scripted policies on the household games with numbered actions (`envs.baseline`), each
  game N times within its turn limit; prints the success per policy and slack.
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
    base = sub.add_parser("baseline", help="scripted policies on the household games (numbered actions)")
    base.add_argument("--policies", default="random,explorer", help="comma-separated: random, explorer")
    base.add_argument(
        "--slack", default="4", help="turns beyond the walkthrough, comma-separated (default 4)"
    )
    base.add_argument("--episodes", type=int, default=10, help="episodes per game and setting (default 10)")
    base.add_argument(
        "--types",
        default="put_on,put_in",
        help="household quest types, comma-separated (default put_on,put_in)",
    )
    base.add_argument("--seed", type=int, default=0, help="seed of the policies' random choices")
    base.add_argument("--json", help="also write the results here (JSON)")


def main(args: argparse.Namespace) -> int:
    if args.envs_command == "prepare":
        return _prepare(args.force, args.procs)
    if args.envs_command == "check":
        return _check(args.family, args.all)
    if args.envs_command == "baseline":
        return _baseline(args)
    return _play(args.family, args.task_id)


def _family(name: str):  # type: ignore[no-untyped-def]
    from rollart_hpc.tasks.families.household_data import is_ready
    from rollart_hpc.tasks.registry import FAMILIES, make_family

    if name not in FAMILIES:
        raise UsageError(f"unknown env family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    if name == "household" and not is_ready():
        raise UsageError("household games are not prepared: run `launch.py envs prepare`")
    return make_family(name)


def _prepare(force: bool, procs: int) -> int:
    from rollart_hpc.tasks.families.household_data import prepare

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
    from rollart_hpc.tasks.demos import run_oracle

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


def _csv(text: str, what: str) -> list[str]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise UsageError(f"--{what}: expected a comma-separated list, got {text!r}")
    return items


def baseline_settings(args: argparse.Namespace) -> tuple[list[str], list[int], list[str]]:
    """Validated (policies, slacks, types) of `envs baseline`; a bad value is a one-line UsageError."""
    from rollart_hpc.config.choices import HOUSEHOLD_TYPES
    from rollart_hpc.envs.baseline import EXPLORER_TYPES, POLICIES

    policies = _csv(args.policies, "policies")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise UsageError(f"--policies: unknown {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    try:
        slacks = [int(part) for part in _csv(args.slack, "slack")]
    except ValueError:
        raise UsageError(f"--slack: expected comma-separated integers, got {args.slack!r}") from None
    if min(slacks) < 0 or args.episodes < 1:
        raise UsageError(f"--slack must be >= 0 and --episodes >= 1, got {args.slack!r}, {args.episodes}")
    types = _csv(args.types, "types")
    bad = [t for t in types if t not in HOUSEHOLD_TYPES]
    if bad:
        raise UsageError(f"--types: unknown {', '.join(bad)}; known: {', '.join(HOUSEHOLD_TYPES)}")
    if "explorer" in policies and not set(types) <= set(EXPLORER_TYPES):
        raise UsageError(
            f"--types: the explorer plays only {', '.join(EXPLORER_TYPES)} (one object, one target)"
        )
    return policies, slacks, types


def _baseline(args: argparse.Namespace) -> int:
    import random

    from rollart_hpc.envs.baseline import make_policy, play
    from rollart_hpc.tasks.registry import make_family

    policies, slacks, types = baseline_settings(args)
    _family("household")  # a clear error when the games are not prepared
    results: dict[str, dict[str, object]] = {}
    print(f"{'policy':>9} {'slack':>5} {'won':>9} {'success':>8} {'games won':>10}")
    for policy in policies:
        for slack in slacks:
            family = make_family("household", slack=slack, types=tuple(types), numbered=True)
            tasks = family.tasks()
            rng = random.Random(f"{args.seed}/{policy}/{slack}")
            env = family.make_env()
            try:
                wins = {t.id: sum(play(env, t, make_policy(policy, t, rng)).won for _ in range(args.episodes))
                        for t in tasks}  # fmt: skip
            finally:
                env.close()
            won, episodes = sum(wins.values()), len(tasks) * args.episodes
            games_won = sum(1 for w in wins.values() if w)
            results.setdefault(policy, {})[str(slack)] = {
                "won": won, "episodes": episodes, "success": won / episodes, "games": len(tasks),
                "games_won": games_won, "wins_per_game": wins,
            }  # fmt: skip
            print(
                f"{policy:>9} {slack:>5} {won:>4}/{episodes:<4} {won / episodes:>8.1%} {games_won:>4}/{len(tasks)}"
            )
    if args.json:
        from pathlib import Path

        from rollart_hpc.contracts.atomic import atomic_write_json

        out = {"episodes_per_game": args.episodes, "types": types, "seed": args.seed, "policies": results}
        atomic_write_json(Path(args.json), out)
        print(f"wrote {args.json}")
    return 0
