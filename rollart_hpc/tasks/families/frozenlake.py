"""frozenlake: gymnasium's FrozenLake-v1 as a text game over a fixed set of shipped maps.

Rendering follows ROLL's text FrozenLake: one row per line, `P` the player, `_` frozen ice, `O` a hole,
`G` the goal, `X` the player in a hole, `W` the player on the goal. The model replies with one move word
(left, down, right, up; case-insensitive, the first such word in the reply counts). The lake is not
slippery, so every shipped map has a shortest path, which is the oracle (breadth-first search). Falling
into a hole ends the episode with reward 0; reaching the goal ends it with reward 1; an unknown move
leaves the state unchanged.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rollart_hpc.tasks.types import Task

FAMILY = "frozenlake"
SYSTEM = "Move P to G. Do not step on O. Reply with one move: left, down, right or up."
MOVES = ("left", "down", "right", "up")  # gymnasium's action ids 0..3
_DELTAS = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}

# Shipped maps: gymnasium's 4x4 and 8x8 presets plus maps from `generate_random_map(size, p=0.8, seed)`.
MAPS: dict[str, tuple[str, ...]] = {
    "4x4": ("SFFF", "FHFH", "FFFH", "HFFG"),
    "8x8": ("SFFFFFFF", "FFFFFFFF", "FFFHFFFF", "FFFFFHFF", "FFFHFFFF", "FHHFFFHF", "FHFFHFHF", "FFFHFFFG"),
    "r4-100": ("SFFF", "HFFH", "FFHF", "FFFG"),
    "r4-101": ("SFFF", "FHHF", "HFHF", "FFHG"),
    "r4-102": ("SFHF", "FFHF", "HFFF", "FFHG"),
    "r4-103": ("SFFH", "HFFF", "FFFF", "FHFG"),
    "r4-104": ("SFFF", "FFFF", "FHFF", "FHFG"),
    "r4-105": ("SHFF", "FFHF", "FFFF", "FFFG"),
    "r5-100": ("SFFFH", "FFHFF", "HFFFF", "FHFFF", "HHFFG"),
    "r5-101": ("SFFFF", "HHFHF", "HFFFH", "FFFFF", "FFFFG"),
    "r5-102": ("SFHFF", "FHFHF", "FFFFH", "HHFFF", "HFFFG"),
    "r5-103": ("SFFHH", "FFFFF", "FFFHF", "FFFHF", "FFHFG"),
    "r5-104": ("SFFFF", "FFFFH", "FFFHF", "FFFFF", "FFFFG"),
    "r5-105": ("SHFFF", "FHFFF", "FFFFF", "FFFFF", "FFHFG"),
    "r6-100": ("SFFFHF", "FHFFHF", "FFFFHF", "FFHHFF", "HFFFFF", "FFFFFG"),
    "r6-101": ("SFFFFH", "HFHFHF", "FFHFFF", "FFFFFF", "HHFFHH", "FFHFFG"),
    "r6-102": ("SFHFFF", "HFHFFF", "FFHHHF", "FFHFFF", "FFFFFF", "FHHFFG"),
    "r6-103": ("SFFHHF", "FFFFFF", "FHFFFF", "HFFFHF", "FFFFFF", "FFFFFG"),
}


def task_id(map_name: str) -> str:
    return f"{FAMILY}/{map_name}"


def map_of(tid: str) -> tuple[str, ...]:
    prefix, _, name = tid.partition("/")
    if prefix != FAMILY or name not in MAPS:
        raise KeyError(f"unknown {FAMILY} task id {tid!r}")
    return MAPS[name]


def shortest_path(desc: tuple[str, ...]) -> list[str]:
    """Moves of a shortest hole-free path from S to G (breadth-first search)."""
    rows, cols = len(desc), len(desc[0])
    start = next((r, c) for r in range(rows) for c in range(cols) if desc[r][c] == "S")
    parent: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        r, c = queue.popleft()
        if desc[r][c] == "G":
            return _unwind(parent, (r, c))
        for move in MOVES:
            dr, dc = _DELTAS[move]
            nxt = (r + dr, c + dc)
            if (
                0 <= nxt[0] < rows
                and 0 <= nxt[1] < cols
                and desc[nxt[0]][nxt[1]] != "H"
                and nxt not in parent
            ):
                parent[nxt] = ((r, c), move)
                queue.append(nxt)
    raise ValueError("map has no path from S to G")


def _unwind(
    parent: dict[tuple[int, int], tuple[tuple[int, int], str] | None], cell: tuple[int, int]
) -> list[str]:
    moves: list[str] = []
    link = parent[cell]
    while link is not None:
        cell, move = link
        moves.append(move)
        link = parent[cell]
    return moves[::-1]


def render(desc: tuple[str, ...], position: int) -> str:
    cols = len(desc[0])
    symbols = {"S": "_", "F": "_", "H": "O", "G": "G"}
    grid = [[symbols[ch] for ch in row] for row in desc]
    r, c = divmod(position, cols)
    grid[r][c] = {"H": "X", "G": "W"}.get(desc[r][c], "P")
    return "\n".join("".join(row) for row in grid)


def parse_move(text: str) -> int | None:
    """The gymnasium action id of the first move word in `text`, or None."""
    words = "".join(ch if ch.isalpha() else " " for ch in text.lower()).split()
    for word in words:
        if word in MOVES:
            return MOVES.index(word)
    return None


class FrozenLakeEnv:
    """gymnasium FrozenLake-v1 (not slippery) behind the text Env contract."""

    def __init__(self) -> None:
        self._gym: Any = None
        self._desc: tuple[str, ...] = ()

    def reset(self, task_id: str) -> str:
        import gymnasium as gym

        self.close()
        self._desc = map_of(task_id)
        self._gym = gym.make("FrozenLake-v1", desc=list(self._desc), is_slippery=False)
        state, _ = self._gym.reset(seed=0)
        return render(self._desc, int(state))

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._gym is None:
            raise RuntimeError("step before reset")
        action = parse_move(action_text)
        if action is None:
            state = int(self._gym.unwrapped.s)
            return "Invalid move.\n" + render(self._desc, state), 0.0, False, {"won": False}
        state, reward, terminated, truncated, _ = self._gym.step(action)
        won = bool(terminated and reward > 0)
        done = bool(terminated or truncated)
        if done:
            self.close()
        return render(self._desc, int(state)), float(reward), done, {"won": won}

    def close(self) -> None:
        if self._gym is not None:
            self._gym.close()
            self._gym = None


class FrozenLakeFamily:
    """The shipped FrozenLake maps; the turn limit is the shortest path plus `slack` moves."""

    name = FAMILY

    def __init__(self, slack: int = 4) -> None:
        self.slack = slack

    def tasks(self) -> list[Task]:
        return [self.task(task_id(name)) for name in MAPS]

    def heldout_tasks(self, count: int) -> list[Task]:
        """frozenlake has no held-out split (its maps are fixed)."""
        if count:
            raise ValueError(f"frozenlake has no held-out tasks, {count} asked")
        return []

    def task(self, tid: str) -> Task:
        desc = map_of(tid)
        size = f"{len(desc)}x{len(desc[0])}"
        max_turns = len(shortest_path(desc)) + self.slack
        return Task(tid, FAMILY, (FAMILY, size), max_turns, SYSTEM, "Move P to G; avoid O.")

    def make_env(self) -> FrozenLakeEnv:
        return FrozenLakeEnv()

    def oracle(self, tid: str) -> list[str]:
        return shortest_path(map_of(tid))
