"""Nothing outlives its rank: a trainer SIGKILLed during or right after a checkpoint save ends the run
within seconds with the rank named, and no process of the run (ranks and every helper they started, e.g.
dist_checkpointing's Manager) is left. Also the parent-death binding on its own (no MPI)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from launching import REPO, start_run, wait_until

TRAINER_RANK = 4  # configs/tiny.toml: controller 0, rollout 1, env 2, reward 3, trainer 4


def rank_pids(run_dir):
    pids = {}
    for path in (run_dir / "pids").glob("rank-*.pid"):
        try:
            pids[int(path.stem.split("-")[1])] = json.loads(path.read_text())["pid"]
        except (OSError, ValueError):
            continue
    return pids


def descendants(pids):
    found = set()
    for pid in pids:
        try:
            found |= {p.pid for p in psutil.Process(pid).children(recursive=True)} | {pid}
        except psutil.NoSuchProcess:
            continue
    return found


def alive(pids):
    """Pids still running (a zombie waiting for a reaper has ended)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            continue
    return sorted(running)


def trainer_save_started(run_dir):
    return any(run_dir.glob("checkpoints/step-*/.trainer.tmp")) or any(
        run_dir.glob("checkpoints/step-*/trainer")
    )


def trainer_save_finished(run_dir):
    return any(run_dir.glob("checkpoints/step-*/COMPLETE"))


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("when", ["during", "after"])
def test_trainer_killed_around_checkpoint_ends_run_and_leaves_nothing(tmp_path, when):
    run_dir = tmp_path / when
    launcher = start_run(
        run_dir, "controller.mode=sync", "controller.num_steps=6", "controller.checkpoint_every_steps=1"
    )
    try:
        wait_until(lambda: len(rank_pids(run_dir)) == 5, 300, 0.2)
        reached = trainer_save_started if when == "during" else trainer_save_finished
        wait_until(lambda: reached(run_dir), 400, 0.005)
        tracked = descendants(rank_pids(run_dir).values())
        os.kill(rank_pids(run_dir)[TRAINER_RANK], signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    assert f"rank {TRAINER_RANK} (trainer) died without reporting an error" in err, err[-3000:]
    assert took < 30, f"the launcher took {took:.0f}s to end the run"
    assert len(tracked) > 5, "expected helper processes of the ranks (env children, checkpoint Manager)"
    wait_until(lambda: not alive(tracked), 5, 0.1)


BOUND_FORK = textwrap.dedent(
    """
    import os, signal, sys, time
    from rollart_hpc.cluster import lifetime
    lifetime.bind_children()
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, flush=True)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_forked_child_dies_with_its_bound_parent():
    proc = subprocess.run(
        [sys.executable, "-c", BOUND_FORK], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert proc.returncode == -signal.SIGKILL
    child = int(proc.stdout.split()[0])
    wait_until(lambda: not alive([child]), 5, 0.05)
