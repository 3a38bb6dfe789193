"""The id grammar of episodes and LLM requests, as typed records with one parser each.

An episode id names an `EpisodeTicket`. Training episodes are `ep<digits>` (`controller.core` writes
`ep<8 digits>`). An evaluation episode is `eval-r<round>-<mode>-<index>`: `round` is the policy version the
round evaluates, `mode` is `s` (sampled with the run's sampling settings) or `g` (greedy, temperature 0),
`index` is the episode's place in the round's fixed list (task, sample). Any other text is an id of kind
`other` (tests and benchmarks name their own episodes), kept as written.

A request id names one LLM turn of an episode: `<episode id>/t<turn>`; a bare episode id is a request id
without a turn. Routing hashes the episode part, so all turns of an episode reach the same rollout rank;
sampling seeds use the request id without the evaluation round (`RequestId.seed_key`), so every evaluation
round plays each (task, sample) with the same sampling noise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

EpisodeKind = Literal["train", "eval", "other"]
EVAL_PREFIX = "eval-"
_TRAIN = re.compile(r"ep(\d+)")
_EVAL = re.compile(r"eval-r(\d+)-([sg])-(\d+)")


@dataclass(frozen=True)
class EpisodeId:
    """A parsed episode id. `index` is the training episode's number or the evaluation episode's place in
    its round; `eval_round` (the evaluated version) and `greedy` belong to evaluation ids."""

    kind: EpisodeKind
    text: str
    index: int = -1
    eval_round: int = -1
    greedy: bool = False

    @classmethod
    def train(cls, index: int) -> EpisodeId:
        return cls("train", f"ep{index:08d}", index)

    @classmethod
    def evaluation(cls, round_version: int, greedy: bool, index: int) -> EpisodeId:
        text = f"{EVAL_PREFIX}r{round_version:06d}-{'g' if greedy else 's'}-{index:06d}"
        return cls("eval", text, index, round_version, greedy)

    @classmethod
    def parse(cls, text: str) -> EpisodeId:
        """The record of `text`; never fails (an id outside the grammar is kind 'other')."""
        if match := _EVAL.fullmatch(text):
            return cls("eval", text, int(match.group(3)), int(match.group(1)), match.group(2) == "g")
        if match := _TRAIN.fullmatch(text):
            return cls("train", text, int(match.group(1)))
        return cls("other", text)

    @property
    def is_eval(self) -> bool:
        return self.kind == "eval"

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class RequestId:
    """A parsed request id: the episode it belongs to and what follows the first '/' (`t<turn>` for an
    agent's turn; None for a bare episode id, with no '/')."""

    episode: str
    rest: str | None = None

    @classmethod
    def of_turn(cls, episode: str, turn: int) -> RequestId:
        return cls(episode, f"t{turn}")

    @classmethod
    def parse(cls, text: str) -> RequestId:
        """The record of `text`; never fails."""
        episode, sep, rest = text.partition("/")
        return cls(episode, rest if sep else None)

    @property
    def turn(self) -> int | None:
        rest = self.rest or ""
        return int(rest[1:]) if rest[:1] == "t" and rest[1:].isdigit() else None

    @property
    def seed_key(self) -> str:
        """The request id without its evaluation round: what seeds the request's sampling."""
        episode = EpisodeId.parse(self.episode)
        if not episode.is_eval:
            return str(self)
        mode, index = episode.text.split("-")[2:]
        return str(RequestId(f"{EVAL_PREFIX}{mode}-{index}", self.rest))

    def __str__(self) -> str:
        return self.episode if self.rest is None else f"{self.episode}/{self.rest}"
