"""Episode ids of evaluation episodes: what the id of an `EpisodeTicket` says about how to play it.

The grammar and its one parser are `rollart_hpc.contracts.ids` (`EpisodeId`, `RequestId`); these are the
questions the roles ask of an id. The env rank reads the mode from the id (greedy turns), the controller routes
results by kind (evaluation never reaches the trainer, tracker or sampler), and an LLM request's seed is
derived from its id without the round (`seed_key`), so every round plays each (task, sample) with the same
sampling noise.
"""

from __future__ import annotations

from rollart_hpc.contracts.ids import EVAL_PREFIX, EpisodeId, RequestId

__all__ = [
    "EVAL_PREFIX",
    "eval_episode_id",
    "eval_round_of",
    "is_eval_episode",
    "is_greedy_episode",
    "seed_key",
]


def eval_episode_id(round_version: int, greedy: bool, index: int) -> str:
    return str(EpisodeId.evaluation(round_version, greedy, index))


def is_eval_episode(episode_id: str) -> bool:
    return EpisodeId.parse(episode_id).is_eval


def is_greedy_episode(episode_id: str) -> bool:
    return EpisodeId.parse(episode_id).greedy


def eval_round_of(episode_id: str) -> int | None:
    """The version an evaluation episode's round evaluates (None for another id)."""
    parsed = EpisodeId.parse(episode_id)
    return parsed.eval_round if parsed.is_eval else None


def seed_key(request_id: str) -> str:
    """The part of a request id (`<episode id>/t<turn>`) that seeds its sampling: evaluation ids lose
    their round, so every round's episode `index` samples alike; other ids are kept whole."""
    return RequestId.parse(request_id).seed_key
