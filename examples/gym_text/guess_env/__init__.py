"""A text gymnasium env of our own: find a hidden number from 'higher' / 'lower' hints.

Observations and actions are strings. The agent replies `<guess>N</guess>`; the env answers `higher`,
`lower` or `correct`, and the episode ends when the number is found (reward 1.0) or after `max_guesses`
guesses (truncated, reward 0.0).
"""

from __future__ import annotations

import re
from typing import Any

import gymnasium as gym

HIGH = 16


def hidden_number(seed: int) -> int:
    return 1 + (seed * 7 + 3) % HIGH


class GuessEnv(gym.Env):
    """The number is a function of the reset seed, so each seed is one fixed task."""

    def __init__(self, max_guesses: int = 5) -> None:
        self.observation_space = gym.spaces.Text(max_length=64)
        self.action_space = gym.spaces.Text(max_length=64)
        self.max_guesses = max_guesses
        self.number, self.guesses = 0, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self.number = hidden_number(seed or 0)
        self.guesses = 0
        return f"Find the number from 1 to {HIGH}.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.guesses += 1
        found = re.search(r"<guess>\s*(\d+)", action)
        truncated = self.guesses >= self.max_guesses
        if found is None:
            return "error: reply <guess>N</guess>", 0.0, False, truncated, {}
        guess = int(found.group(1))
        if guess == self.number:
            return "correct", 1.0, True, False, {}
        return ("higher" if guess < self.number else "lower"), 0.0, False, truncated, {}


def solve(seed: int) -> list[str]:
    """The binary search that wins the episode of `seed`."""
    low, high, replies = 1, HIGH, []
    target = hidden_number(seed)
    while True:
        guess = (low + high) // 2
        replies.append(f"<guess>{guess}</guess>")
        if guess == target:
            return replies
        low, high = (guess + 1, high) if guess < target else (low, guess - 1)
