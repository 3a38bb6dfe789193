"""Scripted policies on the household games with numbered actions: how far a policy gets that reads only
the text the model reads, without learning anything.

- `random`: a uniformly random number from the listed actions each turn (chance).
- `explorer`: follows the objective's cues in what is shown, with no map and no memory of the layout
  beyond the current episode's opened containers: put or insert the object into the target when listed;
  open the target when holding the object and it is closed; take the object when listed; otherwise open a
  container not opened yet in this episode (the object may be inside one) or walk through a random exit.

Both play each game within the task's own turn limit (walkthrough length + the family's slack), so their
success is what that budget allows a policy that has to find the object and the target by looking. Used by
`launch.py envs baseline`; results are per policy and slack, with the per-game wins.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rollart_hpc.tasks.types import Task

OBJECTIVE = re.compile(r"put the (?P<obj>.+?) (?:in|on|into|onto) the (?P<target>.+?)\s*\.?\s*$")
ACTIONS_PREFIX = "Actions: "
POLICIES = ("random", "explorer")
EXPLORER_TYPES = ("put_in", "put_on", "open_then_put", "other_room")  # one object, one target


def parse_objective(text: str) -> tuple[str, str]:
    """(object, target) of a household objective such as "put the book in the wardrobe."."""
    match = OBJECTIVE.search(text.strip().lower())
    if match is None or " and the " in match["obj"]:
        raise ValueError(f"not a put-in/put-on objective: {text!r}")
    return match["obj"], match["target"]


def listed_actions(observation: str) -> list[str]:
    """The numbered actions of an observation, in order ("Actions: 1: go north | 2: inventory")."""
    lines = [line for line in observation.splitlines() if line.startswith(ACTIONS_PREFIX)]
    if not lines:
        return []
    actions: list[str] = []
    for entry in lines[-1].removeprefix(ACTIONS_PREFIX).split(" | "):
        number, _, command = entry.partition(": ")
        if not number.isdigit() or int(number) != len(actions) + 1:
            raise ValueError(f"malformed action list entry {entry!r}")
        actions.append(command)
    return actions


@dataclass
class Explorer:
    """The cue-following policy of one episode (see the module docstring)."""

    obj: str
    target: str
    rng: random.Random
    opened: set[str] = field(default_factory=set)

    def __call__(self, observation: str) -> str:
        actions = listed_actions(observation)
        if not actions:
            return "1"
        holding = f"drop {self.obj}" in actions
        wanted = [f"put {self.obj} on {self.target}", f"insert {self.obj} into {self.target}"]
        if holding:
            wanted.append(f"open {self.target}")
        else:
            wanted += [a for a in actions if a.startswith(f"take {self.obj}")]
        for action in wanted:
            if action in actions:
                return self._choose(actions, action)
        closed = [a for a in actions if a.startswith("open ") and a not in self.opened]
        if not holding and closed:
            return self._choose(actions, self.rng.choice(closed))
        exits = [a for a in actions if a.startswith("go ")]
        return self._choose(actions, self.rng.choice(exits or actions))

    def _choose(self, actions: list[str], action: str) -> str:
        if action.startswith("open "):
            self.opened.add(action)
        return str(actions.index(action) + 1)


def random_policy(rng: random.Random) -> Callable[[str], str]:
    return lambda observation: str(rng.randint(1, max(1, len(listed_actions(observation)))))


@dataclass(frozen=True)
class EpisodeResult:
    task_id: str
    won: bool
    turns: int


def play(env: object, task: Task, policy: Callable[[str], str]) -> EpisodeResult:
    """One episode of `task` on `env` (a household env with numbered actions) within its turn limit."""
    observation = env.reset(task.id)  # type: ignore[attr-defined]
    for turn in range(task.max_turns):
        observation, _, done, info = env.step(policy(observation))  # type: ignore[attr-defined]
        if done:
            return EpisodeResult(task.id, bool(info.get("won")), turn + 1)
    return EpisodeResult(task.id, False, task.max_turns)


def make_policy(name: str, task: Task, rng: random.Random) -> Callable[[str], str]:
    if name == "random":
        return random_policy(rng)
    if name == "explorer":
        return Explorer(*parse_objective(task.prompt), rng)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
