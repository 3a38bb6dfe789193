"""MPI notification that precedes a weight broadcast: "version n is coming".

The trainer that publishes calls `announce` (one small timed MPI message per receiver), then
`WeightPublisher.publish`. A rollout rank's background thread polls with `poll_announcement` (never
blocks, so an idle period between versions is no timeout) and, once a version is announced, enters
`WeightReceiver.receive`, whose broadcasts are bounded by the group timeout. The classes in
`publisher.py` send no MPI message themselves.
"""

from __future__ import annotations

from rollart_hpc.cluster.world import World

TAG_WEIGHTS_VERSION = 9102


def announce(world: World, receiver_ranks: list[int], version: int) -> None:
    """Tell each receiver (world ranks) that `version` is about to be broadcast."""
    for rank in receiver_ranks:
        world.send(int(version), rank, TAG_WEIGHTS_VERSION)


def poll_announcement(world: World, publisher_rank: int) -> int | None:
    """The next announced version from `publisher_rank`, or None when none is pending."""
    if not world.comm.iprobe(source=publisher_rank, tag=TAG_WEIGHTS_VERSION):
        return None
    return int(world.recv(publisher_rank, TAG_WEIGHTS_VERSION))
