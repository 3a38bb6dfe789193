"""household: 128 TextWorld games (put/take/open tasks in a small house, and tw-cooking recipes).

Games come from the prepared cache (`rollart_hpc.tasks.families.household_data`; `launch.py envs prepare`).
An observation is the game's text with TextWorld's banner, prompt and status line removed, followed
by one line listing the useful admissible commands (`Actions: a | b | ...`; `examine` commands other
than the cookbook and `look` are left out of the list to keep it short, but remain valid). Any text is
accepted as a command: only its first line is sent to the game, so an inadmissible command leaves the
state unchanged. Reward is 1.0 when the game is won (the episode ends on the first win or loss).
The oracle is the game's recorded walkthrough. `heldout_tasks(n)` are the first `n` held-out games of
the kept types (evaluation only; `tasks()`, which the warm start and the task sampler draw from, never holds them).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

from rollart_hpc.tasks.families.household_data import NUM_HELDOUT, game_path, is_heldout, load_manifest
from rollart_hpc.tasks.types import Task

FAMILY = "household"
SYSTEM = "You are in a house. Do the task. Reply with one action from the Actions list."
SYSTEM_NUMBERED = (
    "You are in a house. Do the task. Reply with the number of one action from the Actions list."
)
_BANNER = re.compile(r"^.*\$\$\$\$\$\$\$ *\n", flags=re.S)
_PROMPT = re.compile(r"\n>\s.*$", flags=re.S)
_ENDING = re.compile(r"\*\*\* (The End|You lost!) \*\*\*.*$", flags=re.S)


def task_id(index: int) -> str:
    return f"{FAMILY}/{index:03d}"


def parse_task_id(tid: str) -> int:
    prefix, _, number = tid.partition("/")
    if prefix != FAMILY or not number.isdigit():
        raise KeyError(f"unknown {FAMILY} task id {tid!r}")
    return int(number)


def clean(text: str) -> str:
    """Game text without the ASCII banner, the trailing prompt/status line and the end-of-game menu."""
    text = _PROMPT.sub("", _BANNER.sub("", text))
    text = _ENDING.sub(lambda m: f"*** {m.group(1)} ***", text)
    return re.sub(r"\n{2,}", "\n", text).strip()


def listed_commands(admissible: list[str]) -> list[str]:
    """The admissible commands shown to the model (examine/look left out except the cookbook)."""
    return [
        c for c in admissible if c != "look" and (not c.startswith("examine ") or c == "examine cookbook")
    ]


def observation(text: str, admissible: list[str], numbered: bool = False) -> str:
    listed = listed_commands(admissible)
    shown = [f"{i}: {c}" for i, c in enumerate(listed, 1)] if numbered else listed
    return f"{clean(text)}\nActions: {' | '.join(shown)}"


def resolve_action(text: str, admissible: list[str], numbered: bool) -> str | None:
    """The admissible command meant by the model's reply (its text, or its number when numbered), or None."""
    lines = text.strip().splitlines()
    command = " ".join(lines[0].split()).lower() if lines else ""
    if numbered and command.isdigit():
        listed = listed_commands(admissible)
        index = int(command) - 1
        return listed[index] if 0 <= index < len(listed) else None
    return command if command in admissible else None


class HouseholdEnv:
    """One TextWorld game at a time, started from the prepared cache under `root`."""

    def __init__(self, root: Path | None = None, numbered: bool = False) -> None:
        self._root = root
        self._numbered = numbered
        self._env: Any = None
        self._admissible: list[str] = []

    def reset(self, task_id: str) -> str:
        import textworld

        self.close()
        path = game_path(parse_task_id(task_id), self._root)
        if not path.exists():
            raise FileNotFoundError(f"no household game {path}: run `launch.py envs prepare`")
        infos = textworld.EnvInfos(admissible_commands=True, won=True, lost=True)
        with warnings.catch_warnings():
            # jericho does not know generated games; TextWorld tracks score and state itself.
            warnings.filterwarnings("ignore", message=".*is not fully supported.*")
            self._env = textworld.start(str(path), request_infos=infos)
            state = self._env.reset()
        self._admissible = list(state["admissible_commands"])
        return observation(state.feedback, self._admissible, self._numbered)

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._env is None:
            raise RuntimeError("step before reset")
        command = resolve_action(action_text, self._admissible, self._numbered)
        if command is None:
            # Only listed actions reach the game: interpreter meta-commands (save, restore, script,
            # quit) would write files, prompt for input or crash the interpreter.
            shown = " ".join(action_text.split())[:60]
            feedback = f"Nothing happens: {shown!r} is not one of the actions."
            obs = observation(feedback, self._admissible, self._numbered)
            return obs, 0.0, False, {"won": False, "lost": False}
        state, _, done = self._env.step(command)
        won, lost = bool(state["won"]), bool(state["lost"])
        self._admissible = list(state["admissible_commands"])
        obs = observation(state.feedback, self._admissible, self._numbered)
        if done or won or lost:
            self.close()
        return obs, float(won), bool(done or won or lost), {"won": won, "lost": lost}

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


class HouseholdFamily:
    """The prepared household games; the turn limit is the walkthrough length plus `slack`."""

    name = FAMILY

    def __init__(
        self, root: str | None = None, slack: int = 4, types: tuple[str, ...] = (), numbered: bool = False
    ) -> None:
        self.root = Path(root) if root else None
        self.slack = slack
        self.types = tuple(types)
        self.numbered = numbered
        self._games: dict[str, dict[str, Any]] | None = None
        self._heldout: dict[str, dict[str, Any]] | None = None
        self._numbered_oracle: dict[str, list[str]] = {}

    def _manifest(self) -> dict[str, dict[str, Any]]:
        if self._games is None:
            self._games = {task_id(g["index"]): g for g in load_manifest(self.root)}
        return self._games

    def _heldout_manifest(self) -> dict[str, dict[str, Any]]:
        if self._heldout is None:
            self._heldout = {task_id(g["index"]): g for g in load_manifest(self.root, heldout=True)}
        return self._heldout

    def _game(self, tid: str) -> dict[str, Any] | None:
        index = parse_task_id(tid)
        return (self._heldout_manifest() if is_heldout(index) else self._manifest()).get(tid)

    def tasks(self) -> list[Task]:
        games = self._manifest()
        return [self.task(tid) for tid, g in games.items() if not self.types or g["type"] in self.types]

    def heldout_tasks(self, count: int) -> list[Task]:
        """The first `count` held-out games of the kept types (fewer if fewer exist): never in `tasks()`."""
        if not 0 <= count <= NUM_HELDOUT:
            raise ValueError(f"{FAMILY}: {count} held-out games asked, {NUM_HELDOUT} exist")
        if count == 0:
            return []
        games = self._heldout_manifest().items()
        kept = [tid for tid, g in games if not self.types or g["type"] in self.types]
        return [self.task(tid) for tid in kept[:count]]

    def task(self, tid: str) -> Task:
        game = self._game(tid)
        if game is None:
            raise KeyError(f"unknown {FAMILY} task id {tid!r}")
        tags = (FAMILY, game["type"])
        max_turns = len(game["walkthrough"]) + self.slack
        system = SYSTEM_NUMBERED if self.numbered else SYSTEM
        return Task(tid, FAMILY, tags, max_turns, system, game["objective"])

    def make_env(self) -> HouseholdEnv:
        return HouseholdEnv(self.root, self.numbered)

    def oracle(self, tid: str) -> list[str]:
        """The walkthrough; with numbered actions, each command's number in the list shown at that turn."""
        self.task(tid)
        walkthrough = list(self._game(tid)["walkthrough"])  # type: ignore[index]
        if not self.numbered:
            return walkthrough
        if tid not in self._numbered_oracle:
            self._numbered_oracle[tid] = self._numbers(tid, walkthrough)
        return list(self._numbered_oracle[tid])

    def _numbers(self, tid: str, walkthrough: list[str]) -> list[str]:
        env = HouseholdEnv(self.root, numbered=False)
        numbers = []
        try:
            env.reset(tid)
            for command in walkthrough:
                numbers.append(str(listed_commands(env._admissible).index(command) + 1))
                env.step(command)
        finally:
            env.close()
        return numbers
