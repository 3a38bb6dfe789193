"""The end of an RL run on the controller rank: stopping every rank in order, and the run summary.

Order: env ranks get STOP and return (or fail) what they have in flight; once every env rank has
reported its STATS, leftovers are dropped with cause 'run_end'; then reward, rollout and trainer ranks
get STOP, role by role, and each reports STATS as it exits (a trainer first finishes a background
checkpoint still being written and reports it, which then is marked complete). The accounting is then balanced:
dispatched = trained + dropped + failed.
"""

from __future__ import annotations

import time
from typing import Any

from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.controller import recovery
from rollart_hpc.controller.state import Controller


def shutdown(controller: Controller) -> dict[str, Any]:
    """Stop every rank (see the module docstring); returns the run summary."""
    mailbox, ranks = controller.ctx.mailbox, controller.ctx.ranks
    for rank in ranks["env"]:
        mailbox.send("run end", rank, Tag.STOP)
    pending = set(ranks["env"])
    while pending:
        for msg in [mailbox.wait_for(Tag.STATS), *mailbox.poll()]:
            controller.handle(msg)
            if msg.tag == Tag.STATS:
                pending.discard(msg.source)
                mailbox.unwatch(msg.source)
    core = controller.core
    controller.store.mark(core.drop_leftovers("run_end"), "dropped", core.version, "run_end")
    for role in ("reward", "rollout", "trainer"):
        for rank in ranks[role]:
            mailbox.send("run end", rank, Tag.STOP)
        for rank in ranks[role]:
            controller.handle(mailbox.wait_for(Tag.STATS, source=rank))
            mailbox.unwatch(rank)
        for msg in mailbox.poll():  # a rollout rank's last LOADED / a trainer's CHECKPOINTED precede STATS
            if msg.tag in (Tag.LOADED, Tag.CHECKPOINTED):
                controller.handle(msg)
    recovery.complete_written(controller)  # a background checkpoint the trainers finished at STOP
    return summary(controller)


def summary(controller: Controller) -> dict[str, Any]:
    """summary.json: success by family (first -> last step), the last evaluation round's row (None
    without one), trajectory outcomes, staleness, versions
    loaded per rollout rank, busy seconds per rank, engine / reward pool failures and rebuilds per rollout
    and reward rank, wall-clock and whether the accounting balances."""
    acc = controller.core.accounting()
    trajectories = {"dispatched": acc["dispatched"], "trained": acc["trained"]}
    trajectories.update({f"dropped ({k})": v for k, v in acc["dropped"].items()})
    trajectories.update({f"failed ({k})": v for k, v in acc["failed"].items()})
    first, last = controller.first_success, controller.last_success
    return {
        "success_by_family": {f: f"{first[f]:.2f} -> {last[f]:.2f}" for f in first},
        "trajectories": trajectories,
        "staleness": acc["staleness"],
        "rollout_versions": {str(rank): versions for rank, versions in controller.loaded_history.items()},
        "time_split_s": dict(controller.busy),
        "failures_and_rebuilds": dict(controller.rebuilds),
        "wall_s": time.monotonic() - controller.started,
        "balanced": controller.core.balanced(),
        "eval": controller.evaluator.rows[-1] if controller.evaluator.rows else None,
        "accounting": acc,
    }
