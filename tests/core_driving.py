"""Driving a `ControllerCore` by hand in tests: results for its tickets, and running a run to its end."""

from hypothesis import strategies as st

from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.controller.core import ControllerCore


def finish(ticket, version, failed=False, reward=1.0, n_action=1):
    """The trajectory of `ticket`: two prompt tokens and `n_action` tokens generated at `version`."""
    traj = Trajectory(task_id=ticket.task_id, family="f", tags=(), episode_id=ticket.episode_id)
    traj.append([1, 2], False, [], [])
    traj.append([3] * n_action, True, [-0.5] * n_action, [version] * n_action)
    if failed:
        traj.status, traj.finish_cause = "failed", "crash"
    else:
        traj.reward, traj.success, traj.finish_cause = reward, reward > 0, "done"
    return traj


def train_next_batch(core: ControllerCore, trained_at: dict[str, int], max_staleness: int):
    """Take the next batch if there is one and publish its step, checking that no trajectory is trained
    twice and none beyond the staleness bound; returns the batch (or None)."""
    b = core.next_batch()
    if b is not None:
        for r in b.results:
            assert r.ticket.episode_id not in trained_at
            assert b.step - r.trajectory.oldest_version() <= max_staleness
            trained_at[r.ticket.episode_id] = b.step
        core.on_published(b.step + 1)
    return b


# What a random interleaving does to a core, one (operation, pick) at a time: see `play`.
EVENTS = st.lists(
    st.tuples(st.sampled_from(["dispatch", "finish", "fail", "batch", "rollout"]), st.integers(0, 1000)),
    max_size=120,
)


def play(core: ControllerCore, op: str, pick: int, trained_at: dict[str, int], max_staleness: int):
    """One event of `EVENTS` (finishing or failing the in-flight ticket that `pick` chooses), then the
    invariants: the accounting balances and admission stays within its limit. Returns the batch a
    "batch" event took, else None."""
    b = None
    if op == "dispatch":
        core.dispatch()
    elif op in ("finish", "fail") and core.in_flight:
        ticket = list(core.in_flight.values())[pick % len(core.in_flight)]
        core.on_result(finish(ticket, max(ticket.version, core.rollout_version), failed=op == "fail"))
    elif op == "batch":
        b = train_next_batch(core, trained_at, max_staleness)
    elif op == "rollout":
        core.on_rollout_version(core.version)
    assert core.balanced()
    assert core.admitted <= core.admission_limit()
    return b


def run_to_end(core: ControllerCore, rounds: int) -> None:
    """Liveness: load every version, dispatch, finish everything in flight and train, until the last step."""
    for _ in range(rounds):
        if core.done:
            break
        core.on_rollout_version(core.version)
        while core.dispatch() is not None:
            pass
        for ticket in list(core.in_flight.values()):
            core.on_result(finish(ticket, core.rollout_version))
        b = core.next_batch()
        if b is not None:
            core.on_published(b.step + 1)
    assert core.done and core.balanced()
