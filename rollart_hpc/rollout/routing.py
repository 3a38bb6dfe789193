"""Which rollout rank serves an episode's requests: every turn of an episode goes to the same rank (its KV
prefix lives there), chosen by a hash of the episode id. Standard library only (the simulator uses it too)."""

from __future__ import annotations

import zlib


def rollout_index(request_id: str, num_rollouts: int) -> int:
    """The index, in 0..num_rollouts-1, of the rollout rank for `request_id` ("<episode id>/<turn>" or the
    episode id itself)."""
    episode = request_id.split("/", 1)[0]
    return zlib.crc32(episode.encode()) % num_rollouts
