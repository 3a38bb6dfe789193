"""The controller rank's loop: one thread, poll -> fold -> checkpoint -> dispatch -> train -> liveness.

Each pass: fold every pending RESULT/TRAINED/LOADED/STATS/CHECKPOINTED message into the `Controller`
and mark complete the background checkpoints every trainer rank has written; when a checkpoint is due
and no step is with the trainers, write it (or begin it, `controller.checkpoint_async`) (and end the loop if a stop was
requested); dispatch tickets while admission and env slots allow; hand the next batch to idle
trainers; check peers' liveness. Ends after the last step is trained. Evaluation rounds start in the
pass when due (`Controller.start_due_eval`) and run alongside; `finish_evaluation` then evaluates the
final version (after any round still running) before the run shuts down.
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
        recovery.complete_written(controller)
        if core.done:
            break  # the last step is in: a stop requested now simply ends a finished run
        if recovery.checkpoint_due(controller) and not controller.trainer_busy:
            recovery.save(controller)
            if controller.stop_requested.is_set():
                return True
        if controller.stop_requested.is_set():
            recovery.check_stop_grace()
        controller.start_due_eval()
        controller.dispatch()
        controller.train(recovery.checkpoint_due(controller))
        mailbox.check()
        time.sleep(0.0005)
    return False


def finish_evaluation(controller: Controller) -> None:
    """After the last step: let a running round finish, then evaluate the final version once every
    rollout engine holds it (nothing is trained any more; no training ticket is dispatched)."""
    mailbox, core, evaluator = controller.ctx.mailbox, controller.core, controller.evaluator
    while evaluator.active or evaluator.final_due(core.version):
        for msg in mailbox.poll():
            controller.handle(msg)
        if controller.stop_requested.is_set():
            return  # the run is finished; its last evaluation is given up
        if core.rollout_version == core.version:
            controller.start_due_eval(final=True)
        controller.dispatch(training=False)
        mailbox.check()
        time.sleep(0.0005)
