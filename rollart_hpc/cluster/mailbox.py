"""Tagged message polling and liveness over a World, for the role loops of a run.

Each role loop calls `Mailbox.poll()` between units of work: it receives every pending message (any
source, any tag) without blocking and returns them in arrival order. `wait_for(tag)` blocks for one
message of a tag (others are kept for the next `poll`). Liveness: a daemon thread sends a heartbeat to the
watched ranks every `heartbeat_s`, even while the main thread is busy (a long training step); any message
counts as a sign of life. `check()` (called by `wait_for` and by role loops) raises `PeerTimeoutError`
naming a watched rank not heard from within the peer timeout, so a dead or wedged peer becomes a clear
error instead of a silent hang. Sends are nonblocking; `flush()` completes them within the timeout.
MPI runs with MPI_THREAD_MULTIPLE (see `make_world`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rollart_hpc.cluster.world import World
from rollart_hpc.contracts.errors import PeerTimeoutError
from rollart_hpc.contracts.protocol import ROLE_TAGS, Tag


@dataclass(frozen=True)
class Message:
    source: int
    tag: Tag
    payload: Any


class Mailbox:
    def __init__(self, world: World, watch: Iterable[int], heartbeat_s: float) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.world = world
        # Its own communicator (collective: every rank builds its mailbox at the same point), so the
        # World's rendezvous, barriers and group set-up never meet a role message, nor the reverse.
        self.comm = world.comm.Dup()
        self.heartbeat_s = heartbeat_s
        now = time.monotonic()
        self.last_heard = {rank: now for rank in watch if rank != world.rank}
        self._pending: list[tuple[Any, int]] = []
        self._backlog: list[Message] = []
        # Silence counts only while this rank listens: after a busy stretch without polling (a long
        # training step), every peer gets a whole timeout from the moment listening resumes.
        self._last_poll = now
        self._listening_since = now
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        self._beats.start()

    def _heartbeats(self) -> None:
        pending: list[Any] = []
        while not self._stop.wait(self.heartbeat_s):
            pending = [r for r in pending if not r.Test()]
            for rank in list(self.last_heard):
                pending.append(self.comm.isend(None, dest=rank, tag=Tag.HEARTBEAT))

    def watch(self, ranks: Iterable[int]) -> None:
        now = time.monotonic()
        for rank in ranks:
            if rank != self.world.rank:
                self.last_heard.setdefault(rank, now)

    def unwatch(self, rank: int) -> None:
        self.last_heard.pop(rank, None)

    def send(self, payload: Any, dest: int, tag: Tag) -> None:
        if tag not in ROLE_TAGS:
            raise ValueError(f"{self.world.me}: tag {tag!r} is not a role message tag (contracts.protocol)")
        self._pending.append((self.comm.isend(payload, dest=dest, tag=tag), dest))
        if len(self._pending) > 64:
            self._pending = [(r, d) for r, d in self._pending if not r.Test()]

    def poll(self) -> list[Message]:
        """All messages that have arrived, without blocking; heartbeats are consumed here."""
        status = self._mpi.Status()
        now = time.monotonic()
        if now - self._last_poll > self.heartbeat_s:
            self._listening_since = now
        self._last_poll = now
        messages, self._backlog = self._backlog, []
        while self.comm.iprobe(source=self._mpi.ANY_SOURCE, tag=self._mpi.ANY_TAG, status=status):
            source, tag = status.Get_source(), status.Get_tag()
            payload = self.comm.recv(source=source, tag=tag)
            if tag != Tag.HEARTBEAT and tag not in ROLE_TAGS:
                raise RuntimeError(
                    f"{self.world.me}: message with unknown tag {tag} from {self.world.plan.describe(source)}"
                )
            if source in self.last_heard:
                self.last_heard[source] = time.monotonic()
            if tag != Tag.HEARTBEAT:
                messages.append(Message(source, Tag(tag), payload))
        return messages

    def wait_for(self, tag: Tag | frozenset[Tag], source: int | None = None) -> Message:
        """Block until a message with `tag` (or any tag of a set; from `source`, if given) arrives, in
        arrival order; other messages are kept for the next `poll`. Liveness-checked."""
        tags = tag if isinstance(tag, frozenset) else frozenset([tag])
        pause = 1e-4
        while True:
            messages = self.poll()
            for i, msg in enumerate(messages):
                if msg.tag in tags and (source is None or msg.source == source):
                    self._backlog = messages[:i] + messages[i + 1 :] + self._backlog
                    return msg
            self._backlog = messages + self._backlog
            self.check()
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def check(self) -> None:
        """Raise if a watched peer has been silent longer than the peer timeout."""
        now = time.monotonic()
        for rank, heard in self.last_heard.items():
            if now - max(heard, self._listening_since) > self.world.timeout_s:
                raise PeerTimeoutError(
                    f"{self.world.me}: no message from {self.world.plan.describe(rank)} for "
                    f"{now - heard:.0f}s (peer timeout {self.world.timeout_s:g}s)"
                )

    def flush(self) -> None:
        """Complete every pending send within the peer timeout, then stop the heartbeats."""
        for request, dest in self._pending:
            self.world.wait_request(request, dest, "send")
        self._pending = []

    def close(self) -> None:
        self._stop.set()
        self._beats.join()
