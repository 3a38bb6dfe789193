"""Episode ids of evaluation episodes: what the id of an `EpisodeTicket` says about how to play it.

Training episodes are `ep<8 digits>` (`controller.core`). An evaluation episode is
`eval-r<round>-<mode>-<index>`: `round` is the policy version the round evaluates, `mode` is `s`
(sampled with the run's sampling settings) or `g` (greedy, temperature 0), `index` is the episode's
place in the round's fixed list (task, sample). The env rank reads the mode from the id (greedy turns),
the controller routes results by the prefix (evaluation never reaches the trainer, tracker or sampler),
and an LLM request's seed is derived from its id without the round (`seed_key`), so every round plays
each (task, sample) with the same sampling noise.
"""

from __future__ import annotations

import re

EVAL_PREFIX = "eval-"
_EVAL_ID = re.compile(r"eval-r(\d+)-([sg])-(\d+)")
_ROUND = re.compile(r"^eval-r\d+-")


def eval_episode_id(round_version: int, greedy: bool, index: int) -> str:
    return f"{EVAL_PREFIX}r{round_version:06d}-{'g' if greedy else 's'}-{index:06d}"


def is_eval_episode(episode_id: str) -> bool:
    return episode_id.startswith(EVAL_PREFIX)


def is_greedy_episode(episode_id: str) -> bool:
    match = _EVAL_ID.fullmatch(episode_id)
    return match is not None and match.group(2) == "g"


def eval_round_of(episode_id: str) -> int | None:
    """The version an evaluation episode's round evaluates (None for another id)."""
    match = _EVAL_ID.fullmatch(episode_id)
    return int(match.group(1)) if match else None


def seed_key(request_id: str) -> str:
    """The part of a request id (`<episode id>/t<turn>`) that seeds its sampling: evaluation ids lose
    their round, so every round's episode `index` samples alike; other ids are kept whole."""
    return _ROUND.sub(EVAL_PREFIX, request_id, count=1)
