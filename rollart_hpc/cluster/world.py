"""One MPI world, a communicator per role, and torch.distributed groups set up from MPI rendezvous.

Who waits on whom: every blocking wait in this module (point-to-point receive, barrier, rendezvous,
torch collective) has a deadline. When it passes, `PeerTimeoutError` names this rank and the peer that
did not answer (role and rank), so a silent peer becomes a clear error, never a hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollart_hpc.cluster.env import ProcessEnv
from rollart_hpc.cluster.plan import RunPlan
from rollart_hpc.config.schema import ROLE_NAMES
from rollart_hpc.contracts.errors import PeerTimeoutError
from rollart_hpc.contracts.protocol import Tag

if TYPE_CHECKING:
    from mpi4py import MPI


@dataclass
class World:
    """This rank's view of the run: MPI communicators, role, plan and timeouts."""

    comm: MPI.Intracomm
    plan: RunPlan
    env: ProcessEnv
    timeout_s: float
    role_comm: MPI.Comm = field(init=False)
    store_host: str = ""
    """This node's address for rendezvous stores served to other nodes ('' = its host name's address)."""

    def __post_init__(self) -> None:
        self.rank = self.comm.Get_rank()
        self.role = self.plan.role_of(self.rank).role
        self.role_rank = self.rank - self.plan.range_of(self.role).start
        self.role_comm = self.comm.Split(color=ROLE_NAMES.index(self.role), key=self.rank)

    @property
    def me(self) -> str:
        return self.plan.describe(self.rank)

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send `obj` to world rank `dest`; completes once the message is buffered or received."""
        self.wait_request(self.comm.isend(obj, dest=dest, tag=tag), dest, f"send (tag {tag})")

    def wait_request(self, request: MPI.Request, peer: int, what: str) -> None:
        """Wait for a nonblocking MPI request within the peer timeout."""
        self._wait(request.Test, peer, what)

    def recv(self, source: int, tag: int = 0, timeout_s: float | None = None) -> Any:
        """Receive from world rank `source` within the timeout, or raise naming that peer."""
        self._wait(
            lambda: self.comm.iprobe(source=source, tag=tag), source, f"message (tag {tag})", timeout_s
        )
        return self.comm.recv(source=source, tag=tag)

    def _wait(self, done: Any, peer: int, what: str, timeout_s: float | None = None) -> None:
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline, pause = time.monotonic() + limit, 1e-4
        while not done():
            if time.monotonic() > deadline:
                raise PeerTimeoutError(
                    f"{self.me} waited {limit:g}s for {what} from {self.plan.describe(peer)}: no answer"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def barrier(self) -> None:
        """Every rank checks in with rank 0, then waits for its release; silent peers are named."""
        if self.rank == 0:
            for peer in range(1, self.plan.world_size):
                self.recv(peer, Tag.BARRIER)
            for peer in range(1, self.plan.world_size):
                self.send(None, peer, Tag.BARRIER)
        else:
            self.send(None, 0, Tag.BARRIER)
            self.recv(0, Tag.BARRIER)

    def bcast_from_root(self, obj: Any) -> Any:
        """Broadcast a small object from rank 0 to every rank, with timeouts."""
        if self.rank == 0:
            for peer in range(1, self.plan.world_size):
                self.send(obj, peer, Tag.RENDEZVOUS)
            return obj
        return self.recv(0, Tag.RENDEZVOUS)

    def gather_to_root(self, obj: Any) -> list[Any] | None:
        if self.rank == 0:
            return [obj] + [self.recv(peer, Tag.RENDEZVOUS) for peer in range(1, self.plan.world_size)]
        self.send(obj, 0, Tag.RENDEZVOUS)
        return None


def make_world(plan: RunPlan, env: ProcessEnv, timeout_s: float, store_host: str = "") -> World:
    """Initialise MPI (threads allowed) and build this rank's World; checks the world size matches the plan.
    `store_host`: this node's address for rendezvous stores ('' = the address its host name resolves to)."""
    import mpi4py

    mpi4py.rc.threads = True
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != plan.world_size:
        raise RuntimeError(f"MPI world has {comm.Get_size()} ranks but the run plan needs {plan.world_size}")
    return World(comm, plan, env, timeout_s, store_host=store_host)
