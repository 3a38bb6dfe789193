"""Run under mpiexec by tests/test_world_mpi.py: python mailbox_check.py OUT_DIR.

Rank 1 is busy (no polling) for longer than the peer timeout, then waits for a message: it must not
report the controller as silent. Rank 2 stops its heartbeats and stays quiet: the controller's wait must
end in a PeerTimeoutError naming rank 2.
"""

import json
import sys
import time
from pathlib import Path

from rollart_hpc.cluster.env import read_process_env
from rollart_hpc.cluster.mailbox import Mailbox
from rollart_hpc.cluster.plan import make_plan
from rollart_hpc.cluster.world import make_world
from rollart_hpc.config.loader import build
from rollart_hpc.config.schema import RolesConfig
from rollart_hpc.contracts.errors import PeerTimeoutError
from rollart_hpc.contracts.protocol import Tag

TIMEOUT = 4.0


def main() -> None:
    out = Path(sys.argv[1])
    roles = build(RolesConfig, {"reward": {"num_ranks": 0}})  # controller, rollout, env, trainer
    world = make_world(make_plan(roles), read_process_env(), TIMEOUT)
    mailbox = Mailbox(world, range(4) if world.rank == 0 else [0], heartbeat_s=0.5)
    result: dict = {}
    if world.rank == 0:
        mailbox.unwatch(3)
        time.sleep(TIMEOUT + 2)
        mailbox.send("go", 1, tag=Tag.BATCH)
        result["done"] = mailbox.wait_for(Tag.WEIGHTS, source=1).payload
        mailbox.unwatch(1)
        try:
            mailbox.wait_for(Tag.TRAINED)
        except PeerTimeoutError as exc:
            result["error"] = str(exc)
    elif world.rank == 1:
        start = time.monotonic()
        while time.monotonic() - start < TIMEOUT + 1:
            pass  # busy: no polling
        result["got"] = mailbox.wait_for(Tag.BATCH).payload
        mailbox.send("done", 0, tag=Tag.WEIGHTS)
        mailbox.flush()
    elif world.rank == 2:
        mailbox.close()  # heartbeats stop: this rank goes silent
        time.sleep(3 * TIMEOUT + 4)
    (out / f"rank-{world.rank}.json").write_text(json.dumps(result))
    mailbox.close()


if __name__ == "__main__":
    main()
