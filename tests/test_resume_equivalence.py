"""DESIGN invariant 9: in sync mode with a fixed seed, a run stopped at step k and resumed continues as
the uninterrupted run, bit for bit: steps k..n-1 train the same trajectories (episode, task, tokens,
per-token versions, reward, final status) with the same behaviour log-probs, and give the same losses,
grad norms and weights, all compared exactly.

What makes it exact: `rollout.batch_invariant` (each request's forward runs alone, so a token's log-prob
does not depend on which requests shared the engine step, which is timing; without it CPU matmuls round
differently by batch shape, about 1 ulp), per-request seeded sampling, the batch packed in episode order,
and the RNG states of the sampler and tracker in the checkpoint.

Three tiny worlds run at once: the uninterrupted reference, one stopped by SIGUSR1 (checkpoint, clean
exit) and one whose env rank is SIGKILLed right after its first checkpoint; both are resumed together.
"""

import os
import signal
import time
from collections import defaultdict

import pytest
import torch
from launching import metric_rows, rank_pid, start, start_run, stored_records

from rollart_hpc.controller.checkpoint import latest, step_dir

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
NUM_STEPS = 5
OVERRIDES = (
    "controller.mode=sync",
    f"controller.num_steps={NUM_STEPS}",
    "controller.checkpoint_every_steps=2",
    "controller.keep_checkpoints=5",
    "run.seed=7",
    "rollout.batch_invariant=true",
)
# Metrics that depend on timing, not on what was trained.
TIMING_KEYS = {"wall_s", "train_s"}


def finish(proc, ok=True):
    out, err = proc.communicate(timeout=600)
    assert (proc.returncode == 0) == ok, out[-2000:] + err[-3000:]
    return out, err


def metrics(run_dir):
    return {r["step"]: {k: v for k, v in r.items() if k not in TIMING_KEYS} for r in metric_rows(run_dir)}


def trained(run_dir):
    """Per step: the trained trajectories with their ids, tokens, versions and rewards; their log-probs."""
    steps, logprobs = defaultdict(list), {}
    for r in stored_records(run_dir):
        if r.final_status == "trained":
            steps[r.final_version].append(
                (r.episode_id, r.task_id, r.token_ids.tolist(), r.versions.tolist(), float(r.reward))
            )
            logprobs[r.episode_id] = r.logprobs
    return {v: sorted(t) for v, t in steps.items()}, logprobs


def statuses(run_dir):
    return {r.episode_id: (r.final_status, r.final_cause) for r in stored_records(run_dir)}


def weights(run_dir, version):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / f"weights-{version}.pt"
    dcp_to_torch_save(step_dir(run_dir, version) / "trainer", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def assert_same_metrics(got, ref, step):
    assert got == ref, f"step {step}: " + ", ".join(k for k in ref if got.get(k) != ref[k])


def assert_same_after(run_dir, reference, resumed_at):
    ref_metrics, got_metrics = metrics(reference), metrics(run_dir)
    assert sorted(got_metrics) == list(range(NUM_STEPS))
    for step in range(resumed_at, NUM_STEPS):
        assert_same_metrics(got_metrics[step], ref_metrics[step], step)
    (ref_trained, ref_logprobs), (got_trained, got_logprobs) = trained(reference), trained(run_dir)
    for step in range(resumed_at, NUM_STEPS):
        assert got_trained[step] == ref_trained[step], f"trajectories trained in step {step} differ"
        for episode, *_ in ref_trained[step]:
            assert got_logprobs[episode].tolist() == ref_logprobs[episode].tolist(), episode
    assert statuses(run_dir) == statuses(reference)
    ref_w, got_w = weights(reference, 4), weights(run_dir, 4)
    assert ref_w.keys() == got_w.keys()
    for name, tensor in ref_w.items():
        assert torch.equal(got_w[name], tensor), name


def test_stopped_and_killed_runs_resume_exactly(tmp_path):
    reference, stopped, killed = (tmp_path / n for n in ("reference", "stopped", "killed"))
    procs = {d: start_run(d, *OVERRIDES) for d in (reference, stopped, killed)}
    # Each fault is sent the moment its world is ready, watching both worlds at once: the worlds start
    # together but not in step, and a short run may finish while the other is still starting.
    faults = {
        stopped: (
            lambda: (stopped / "metrics.jsonl").exists() and len(metrics(stopped)) >= 1,
            0,
            signal.SIGUSR1,
        ),
        killed: (lambda: latest(killed) is not None, 2, signal.SIGKILL),
    }
    try:
        deadline = time.monotonic() + 600
        while faults:
            for run_dir, (ready, rank, sig) in list(faults.items()):
                if ready():
                    assert procs[run_dir].poll() is None, f"{run_dir.name} ended before its fault"
                    os.kill(rank_pid(run_dir, rank), sig)
                    del faults[run_dir]
            assert time.monotonic() < deadline, f"not ready in time: {[d.name for d in faults]}"
            time.sleep(0.02)
        out, _ = finish(procs[stopped])
        assert "stop requested: checkpointed at version" in out
        finish(procs[killed], ok=False)
        finish(procs[reference])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    stopped_at = int(latest(stopped).name.split("-")[1])
    killed_at = int(latest(killed).name.split("-")[1])
    assert 0 < stopped_at < NUM_STEPS and killed_at == 2
    resumed = [start("resume", stopped), start("resume", killed)]
    for proc in resumed:
        finish(proc)
    assert_same_after(stopped, reference, stopped_at)
    assert_same_after(killed, reference, killed_at)
