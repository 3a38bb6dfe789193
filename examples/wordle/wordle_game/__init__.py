"""A word-guessing game as an environment family of its own, with its reward function.

The agent guesses a secret five-letter word with `<guess>word</guess>`; each guess is answered with one
mark per letter: the letter in capitals where it is right, lower case where the word holds it elsewhere,
`_` where it holds none. The episode ends when the word is found or the turns run out.
"""

from __future__ import annotations

import random
from typing import Any

from rollart_hpc.api import RewardInput, RewardOutput, Task

WORDS = (
    "apple", "bread", "chair", "dance", "eagle", "flame", "grape", "house", "input", "jolly",
    "knife", "lemon", "mango", "night", "ocean", "piano", "queen", "river", "stone", "tiger",
)  # fmt: skip
SYSTEM = "Guess the five-letter word. Reply <guess>word</guess>."
OPENING = "crane"


def secret(task_id: str) -> str:
    """The secret word of task 'wordle/<i>' (word i of a fixed shuffle)."""
    order = list(WORDS)
    random.Random("wordle").shuffle(order)
    return order[int(task_id.partition("/")[2]) % len(order)]


def parse_guess(text: str) -> str:
    start = text.find("<guess>")
    if start < 0:
        return ""
    body = text[start + len("<guess>") :]
    return body.partition("</guess>")[0].strip().lower()


def feedback(guess: str, word: str) -> str:
    return " ".join(
        g.upper() if g == w else (g if g in word else "_") for g, w in zip(guess, word, strict=True)
    )


class WordleEnv:
    def __init__(self) -> None:
        self.word = ""

    def reset(self, task_id: str) -> str:
        self.word = secret(task_id)
        return "A new five-letter word. Your guess?"

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        guess = parse_guess(action_text)
        if len(guess) != 5 or not guess.isalpha():
            return "error: reply <guess>word</guess> with five letters", 0.0, False, {"won": False}
        won = guess == self.word
        return ("solved" if won else feedback(guess, self.word)), float(won), won, {"won": won}

    def close(self) -> None:
        self.word = ""


class WordleFamily:
    name = "wordle"

    def __init__(self, num_words: int = len(WORDS), num_heldout: int = 0, max_turns: int = 4) -> None:
        if not 1 <= num_words + num_heldout <= len(WORDS):
            raise ValueError(f"num_words + num_heldout must be in [1, {len(WORDS)}]")
        self.num_words, self.num_heldout, self.max_turns = num_words, num_heldout, max_turns

    def tasks(self) -> list[Task]:
        return [self.task(f"wordle/{i}") for i in range(self.num_words)]

    def heldout_tasks(self, count: int) -> list[Task]:
        first = self.num_words
        return [self.task(f"wordle/{i}") for i in range(first, first + min(count, self.num_heldout))]

    def task(self, tid: str) -> Task:
        return Task(tid, self.name, (self.name,), self.max_turns, SYSTEM, "Guess the word.", ("</guess>",))

    def make_env(self) -> WordleEnv:
        return WordleEnv()

    def oracle(self, tid: str) -> list[str]:
        return [f"<guess>{OPENING}</guess>", f"<guess>{secret(tid)}</guess>"]


def make_family(**options: Any) -> WordleFamily:
    return WordleFamily(**options)


def score(inp: RewardInput) -> RewardOutput:
    """1.0 for finding the word, else 0.1 per letter of the last guess in its right place."""
    word = secret(inp.task_id)
    last = parse_guess(inp.actions[-1]) if inp.actions else ""
    if last == word:
        return RewardOutput(1.0, True)
    return RewardOutput(0.1 * sum(g == w for g, w in zip(last, word, strict=False)), False)
