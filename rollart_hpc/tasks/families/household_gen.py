"""Generation of the 128 canonical household games with TextWorld (offline, deterministic).

Game `i` has type `TYPES[i % 6]` and seed `1000 + i`; every choice comes from `random.Random(seed)`.
Five types are built with `textworld.GameMaker` in the terse `basic` grammar (a house of 3-4 rooms on a
2x2 grid, 2-4 pieces of furniture per room, 3-6 distractor objects, closed containers and doors):
`put_in`, `put_on`, `two_obj`, `open_then_put`, `other_room`. The sixth, `cook`, is TextWorld's
`tw-cooking` challenge (recipe of 1-2 ingredients, cooking and cutting). Walkthroughs are planned here
(breadth-first over rooms, opening doors and containers on the way) and recorded on the logic engine,
so no command of a walkthrough is inadmissible. Run under `PYTHONHASHSEED=0` for byte-identical files.

`generate_range(ids, out_dir)` writes `game_XXX.z8`/`.json` plus `game_XXX.meta.json` (type, seed,
objective, walkthrough) for each id; `rollart_hpc.tasks.families.household_data` orchestrates processes, replays
every walkthrough and writes the manifest.
"""

from __future__ import annotations

import json
import os
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart_hpc.config.choices import HOUSEHOLD_TYPES as TYPES

NUM_GAMES = 128
BASE_SEED = 1000

_FURNITURE: dict[str, list[tuple[str, str]]] = {  # (name, "c" container | "s" supporter)
    "kitchen": [("fridge", "c"), ("cabinet", "c"), ("dining table", "s"), ("countertop", "s")],
    "living room": [("sofa", "s"), ("coffee table", "s"), ("drawer", "c"), ("bookcase", "s")],
    "bedroom": [("bed", "s"), ("wardrobe", "c"), ("nightstand", "s"), ("dresser", "c")],
    "bathroom": [("sink", "s"), ("laundry basket", "c"), ("towel rack", "s"), ("medicine chest", "c")],
}
_OBJECTS = (
    "mug", "book", "pillow", "remote", "towel", "candle", "vase", "plate", "bowl", "fork", "spoon", "cup",
    "sponge", "soap", "comb", "brush", "clock", "pen", "diary", "phone", "wallet", "hat", "shoe", "sock",
    "shirt", "laptop", "newspaper", "bottle", "apple", "banana",
)  # fmt: skip
_DOORS = ("oak door", "pine door", "red door", "blue door")
_CELLS = ((0, 0), (0, 1), (1, 0), (1, 1))  # (row, col); row 0 is north


@dataclass
class _Furn:
    name: str
    kind: str  # "c" container | "s" supporter
    room: str
    handle: Any
    closed: bool


@dataclass
class _Room:
    name: str
    cell: tuple[int, int]
    handle: Any = None
    furniture: list[_Furn] = field(default_factory=list)


@dataclass
class _Plan:
    """What the walkthrough planner tracks: where the player is and which doors/containers are open."""

    rooms: dict[str, _Room]
    exits: dict[str, dict[str, tuple[str, str | None]]]  # room -> direction -> (room, door or None)
    opened: set[str]
    where: str
    commands: list[str] = field(default_factory=list)

    def furniture(self) -> list[_Furn]:
        return [f for r in self.rooms.values() for f in r.furniture]


@dataclass
class _Goal:
    obj: str
    handle: Any
    source: _Furn
    target: _Furn


def generate_range(ids: list[int], out_dir: Path) -> None:
    """Generate and compile games `ids` into `out_dir` (one meta.json per game, written last)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for i in ids:
        meta = _make_cook(i, out_dir) if TYPES[i % 6] == "cook" else _make_gamemaker(i, out_dir)
        tmp = out_dir / f"game_{i:03d}.meta.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, out_dir / f"game_{i:03d}.meta.json")


def _make_cook(i: int, out_dir: Path) -> dict[str, Any]:
    import textworld
    import textworld.challenges
    from textworld.generator import compile_game

    rng = random.Random(BASE_SEED + i)
    recipe = rng.randint(1, 2)
    settings = dict(recipe=recipe, take=recipe, go=rng.choice([1, 6]), open=True, cook=rng.random() < 0.6,
                    cut=rng.random() < 0.5, drop=False, recipe_seed=BASE_SEED + i, split=None)  # fmt: skip
    opts = textworld.GameOptions()
    opts.seeds = BASE_SEED + i
    opts.path = str(out_dir / f"game_{i:03d}.z8")
    opts.force_recompile = True
    _, make, _ = textworld.challenges.CHALLENGES["tw-cooking"]
    game = make(settings, opts)
    compile_game(game, opts)
    return _meta(i, "cook", game.objective, list(game.walkthrough))


def _meta(i: int, kind: str, objective: str, walkthrough: list[str]) -> dict[str, Any]:
    return {
        "index": i,
        "type": kind,
        "seed": BASE_SEED + i,
        "objective": objective,
        "walkthrough": walkthrough,
    }


def _make_gamemaker(i: int, out_dir: Path) -> dict[str, Any]:
    """Build one GameMaker game; retries with a derived seed if the walkthrough is shorter than 3."""
    for attempt in range(20):
        built = _try_gamemaker(i, attempt)
        if built is not None:
            game, objective, walk = built
            _compile(game, objective, out_dir / f"game_{i:03d}.z8")
            return _meta(i, TYPES[i % 6], objective, walk)
    raise RuntimeError(f"household game {i}: no valid layout in 20 attempts")


def _compile(game: Any, objective: str, path: Path) -> None:
    from textworld import GameOptions
    from textworld.generator import compile_game

    game.objective = objective
    opts = GameOptions()
    opts.path = str(path)
    opts.force_recompile = True
    compile_game(game, opts)


def _try_gamemaker(i: int, attempt: int) -> tuple[Any, str, list[str]] | None:
    from textworld import GameMaker, GameOptions
    from textworld.generator.game import Event, Quest

    rng = random.Random(f"{BASE_SEED + i}:{attempt}")
    opts = GameOptions()
    opts.seeds = BASE_SEED + i
    opts.grammar.theme = "basic"
    maker = GameMaker(options=opts)
    plan = _build_house(maker, rng, need_door=TYPES[i % 6] == "other_room")
    goal = _place_goal(maker, rng, plan, TYPES[i % 6])
    if goal is None:
        return None
    goals, objective = goal
    walk = _plan_walkthrough(plan, goals)
    if len(walk) < 3:
        return None
    facts = [maker.new_fact("in" if g.target.kind == "c" else "on", g.handle, g.target.handle) for g in goals]
    quest = Quest(win_events=[Event(conditions=facts)])
    maker.quests = [quest]
    quest.win_events[0].actions = _record_actions(maker.build(), walk)
    return maker.build(), objective, walk


def _record_actions(game: Any, commands: list[str]) -> list[Any]:
    """Replay `commands` on the logic engine (no compile); ValueError if one is not admissible."""
    from textworld.generator.game import GameProgression
    from textworld.generator.inform7 import Inform7Game

    progression, i7, actions = GameProgression(game, track_quests=False), Inform7Game(game), []
    for cmd in commands:
        valid = progression.valid_actions
        action = valid[i7.gen_commands_from_actions(valid).index(cmd)]
        progression.update(action)
        actions.append(action)
    return actions


def _build_house(maker: Any, rng: random.Random, need_door: bool) -> _Plan:
    names = list(_FURNITURE)
    rng.shuffle(names)
    num_rooms = rng.choice([3, 4])
    cells = list(_CELLS)
    rng.shuffle(cells)
    cells = cells[:num_rooms]  # any three cells of a 2x2 grid form a connected L
    rooms = {n: _Room(n, c, maker.new_room(n)) for n, c in zip(names, cells, strict=False)}
    exits = _connect_rooms(maker, rng, rooms, need_door)
    for room in rooms.values():
        _furnish(maker, rng, room)
    start = rng.choice(sorted(rooms))
    maker.set_player(rooms[start].handle)
    return _Plan(rooms, exits, set(), start)


def _connect_rooms(maker: Any, rng: random.Random, rooms: dict[str, _Room], need_door: bool) -> dict:
    exits: dict[str, dict[str, tuple[str, str | None]]] = {n: {} for n in rooms}
    pairs = [(a, b) for a in rooms.values() for b in rooms.values() if _adjacent(a.cell, b.cell)]
    doors = list(_DOORS)
    forced = rng.randrange(len(pairs)) if need_door else -1
    for k, (a, b) in enumerate(pairs):
        fwd, back = ("south", "north") if b.cell[0] > a.cell[0] else ("east", "west")
        path = maker.connect(getattr(a.handle, fwd), getattr(b.handle, back))
        door = None
        if k == forced or rng.random() < 0.25:
            door = doors.pop(0)
            maker.add_fact("closed", maker.new_door(path, name=door))
        exits[a.name][fwd] = (b.name, door)
        exits[b.name][back] = (a.name, door)
    return exits


def _adjacent(a: tuple[int, int], b: tuple[int, int]) -> bool:
    # Each unordered pair once: b is directly south or east of a.
    return (b[0] - a[0], b[1] - a[1]) in ((1, 0), (0, 1))


def _furnish(maker: Any, rng: random.Random, room: _Room) -> None:
    options = list(_FURNITURE[room.name])
    rng.shuffle(options)
    for name, kind in options[: rng.randint(2, 4)]:
        handle = maker.new(type=kind, name=name)
        closed = kind == "c" and rng.random() < 0.7
        if kind == "c":
            maker.add_fact("closed" if closed else "open", handle)
        room.handle.add(handle)
        room.furniture.append(_Furn(name, kind, room.name, handle, closed))


def _place_goal(maker: Any, rng: random.Random, plan: _Plan, kind: str) -> tuple[list[_Goal], str] | None:
    """Place goal objects and distractors; returns the goals and the objective text."""
    choice = _pick_holders(rng, plan, kind)
    if choice is None:
        return None
    sources, target = choice
    nouns = list(_OBJECTS)
    rng.shuffle(nouns)
    goals = []
    for source in sources:
        name = nouns.pop()
        handle = maker.new(type="o", name=name)
        source.handle.add(handle)
        goals.append(_Goal(name, handle, source, target))
    furniture = plan.furniture()
    for _ in range(rng.randint(3, 6)):
        rng.choice(furniture).handle.add(maker.new(type="o", name=nouns.pop()))
    prep = "in" if target.kind == "c" else "on"
    things = " and the ".join(g.obj for g in goals)
    return goals, f"Your task is to: put the {things} {prep} the {target.name}."


def _pick_holders(rng: random.Random, plan: _Plan, kind: str) -> tuple[list[_Furn], _Furn] | None:
    furniture = plan.furniture()
    containers = [f for f in furniture if f.kind == "c"]
    supporters = [f for f in furniture if f.kind == "s"]
    if kind == "put_in":
        if not containers or not supporters:
            return None
        return [rng.choice(supporters)], rng.choice(containers)
    if kind == "put_on":
        if len(supporters) < 2:
            return None
        source, target = rng.sample(supporters, 2)
        return [source], target
    if kind == "two_obj":
        target = rng.choice(furniture)
        others = [f for f in furniture if f is not target]
        return [rng.choice(others), rng.choice(others)], target
    if kind == "open_then_put":
        closed = [c for c in containers if c.closed]
        if not closed:
            return None
        source = rng.choice(closed)
        return [source], rng.choice([f for f in furniture if f is not source])
    remote = [f for f in furniture if f.room != plan.where]  # other_room
    if not remote:
        return None
    source = rng.choice(remote)
    return [source], rng.choice([f for f in furniture if f.room != source.room])


def _plan_walkthrough(plan: _Plan, goals: list[_Goal]) -> list[str]:
    for goal in goals:
        _go_to(plan, goal.source.room)
        _open(plan, goal.source)
        plan.commands.append(f"take {goal.obj} from {goal.source.name}")
        _go_to(plan, goal.target.room)
        _open(plan, goal.target)
        verb = f"insert {goal.obj} into" if goal.target.kind == "c" else f"put {goal.obj} on"
        plan.commands.append(f"{verb} {goal.target.name}")
    return plan.commands


def _open(plan: _Plan, furn: _Furn) -> None:
    if furn.closed and furn.name not in plan.opened:
        plan.commands.append(f"open {furn.name}")
        plan.opened.add(furn.name)


def _go_to(plan: _Plan, room: str) -> None:
    """Append the moves of a shortest route to `room`, opening closed doors on the way."""
    parents: dict[str, tuple[str, str, str | None]] = {}
    seen, queue = {plan.where}, deque([plan.where])
    while queue:
        here = queue.popleft()
        for direction, (there, door) in sorted(plan.exits[here].items()):
            if there not in seen:
                seen.add(there)
                parents[there] = (here, direction, door)
                queue.append(there)
    steps: list[tuple[str, str | None]] = []
    cur = room
    while cur != plan.where:
        cur, direction, door = parents[cur]
        steps.append((direction, door))
    for direction, door in reversed(steps):
        if door is not None and door not in plan.opened:
            plan.commands.append(f"open {door}")
            plan.opened.add(door)
        plan.commands.append(f"go {direction}")
    plan.where = room


def main(argv: list[str]) -> int:
    """`python -m rollart_hpc.tasks.families.household_gen OUT_DIR FIRST LAST`: generate ids FIRST..LAST-1."""
    out_dir, first, last = Path(argv[0]), int(argv[1]), int(argv[2])
    generate_range(list(range(first, last)), out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
