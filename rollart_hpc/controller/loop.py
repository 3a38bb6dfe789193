"""The controller rank's loop: one thread, poll -> fold -> checkpoint -> dispatch -> train -> liveness.

Each pass: fold every pending RESULT/TRAINED/LOADED/STATS message into the `Controller`; when a
checkpoint is due and no step is with the trainers, write it (and end the loop if a stop was
requested); dispatch tickets while admission and env slots allow; hand the next batch to idle
trainers; check peers' liveness. Ends after the last step is trained.
"""

from __future__ import annotations

import time

from rollart_hpc.controller import recovery
from rollart_hpc.controller.state import Controller


def run(controller: Controller) -> bool:
    """Run until the last step, or until a requested stop has been checkpointed (returns True then)."""
    mailbox, core = controller.ctx.mailbox, controller.core
    while not core.done:
        for msg in mailbox.poll():
            controller.handle(msg)
        if core.done:
            break  # the last step is in: a stop requested now simply ends a finished run
        if recovery.checkpoint_due(controller) and not controller.trainer_busy:
            recovery.save(controller)
            if controller.stop_requested.is_set():
                return True
        if controller.stop_requested.is_set():
            recovery.check_stop_grace()
        controller.dispatch()
        controller.train(recovery.checkpoint_due(controller))
        mailbox.check()
        time.sleep(0.0005)
    return False
