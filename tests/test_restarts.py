"""`--max-restarts N`: a failed world is restarted from its last checkpoint, each restart recorded in
`restarts.jsonl`; a failure that repeats at the same checkpoint step stops the restarts early. The logic
with a fake world, then real tiny runs with a SIGKILLed env rank."""

import json
import os
import re
import signal

import pytest
from launching import REPO, metric_lines, rank_pid, read_summary, start_run, stored_records, wait_until

from rollart_hpc.cluster.restarts import RESTARTS, WorldOutcome, run_with_restarts
from rollart_hpc.contracts.rundir import read_restarts
from rollart_hpc.controller import checkpoint as ckpt
from rollart_hpc.entry.restarts import checkpoint_step

ENV_RANK = 2  # configs/tiny.toml: controller 0, rollout 1, env 2, reward 3, trainer 4


class FakeWorld:
    """Plays back outcomes; a checkpoint step may be 'written' before each outcome."""

    def __init__(self, run_dir, script):
        self.run_dir, self.script, self.calls, self.checks = run_dir, list(script), 0, 0

    def run(self):
        step, outcome = self.script[self.calls]
        self.calls += 1
        if step:
            path = ckpt.step_dir(self.run_dir, step)
            path.mkdir(parents=True, exist_ok=True)
            (path / ckpt.COMPLETE).write_text(json.dumps({"version": step}))
        return outcome

    def check(self):
        self.checks += 1


DIED = WorldOutcome(1, "rank 2 (env) died without reporting an error", False)
OK = WorldOutcome(0, None, False)


def test_restarts_until_success_and_records_each(tmp_path):
    world = FakeWorld(tmp_path, [(1, DIED), (2, DIED), (3, OK)])
    assert run_with_restarts(tmp_path, world.run, 5, world.check, checkpoint_step) == 0
    assert world.calls == 3 and world.checks == 2
    rows = read_restarts(tmp_path)
    assert [(r["restart"], r["step"], r["cause"]) for r in rows] == [(1, 1, DIED.cause), (2, 2, DIED.cause)]


def test_same_failure_at_same_step_stops_early(tmp_path, capsys):
    world = FakeWorld(tmp_path, [(1, DIED), (0, DIED), (0, OK)])
    assert run_with_restarts(tmp_path, world.run, 5, world.check, checkpoint_step) == 1
    assert world.calls == 2 and len(read_restarts(tmp_path)) == 1
    assert "not restarting: the same failure repeated at step 1" in capsys.readouterr().err


def test_silent_deaths_are_one_cause_whichever_rank_is_named(tmp_path, capsys):
    other_rank = WorldOutcome(1, "rank 3 (reward) died without reporting an error", False)
    world = FakeWorld(tmp_path, [(0, other_rank), (0, DIED), (0, OK)])
    assert run_with_restarts(tmp_path, world.run, 5, world.check, checkpoint_step) == 1 and world.calls == 2
    assert "the same failure repeated at step 0" in capsys.readouterr().err
    stack = [WorldOutcome(1, f"rank 0 (controller) failed: File too large\n  at {t}", False) for t in (1, 2)]
    world = FakeWorld(tmp_path / "stack", [(0, stack[0]), (0, stack[1]), (0, OK)])
    assert (
        run_with_restarts(tmp_path / "stack", world.run, 5, world.check, checkpoint_step) == 1
        and world.calls == 2
    )
    reported = [WorldOutcome(1, f"rank 2 (env) failed: {m}", False) for m in ("disk full", "bad game")]
    world = FakeWorld(tmp_path / "reported", [(0, reported[0]), (0, reported[1]), (0, OK)])
    assert (
        run_with_restarts(tmp_path / "reported", world.run, 5, world.check, checkpoint_step) == 0
        and world.calls == 3
    )


def test_no_restart_for_a_stop_by_the_launcher_or_without_budget(tmp_path, capsys):
    stopped = WorldOutcome(130, "rank 0 (controller) died without reporting an error", True)
    world = FakeWorld(tmp_path, [(0, stopped)])
    assert run_with_restarts(tmp_path, world.run, 3, world.check, checkpoint_step) == 130 and world.calls == 1
    world = FakeWorld(tmp_path, [(0, DIED), (0, DIED)])
    assert run_with_restarts(tmp_path, world.run, 1, world.check, checkpoint_step) == 1 and world.calls == 2
    assert "giving up after 1 restarts" in capsys.readouterr().err
    assert not (tmp_path / RESTARTS).with_suffix(".tmp").exists()


def env_pid(run_dir):
    try:
        return rank_pid(run_dir, ENV_RANK)
    except (OSError, ValueError, KeyError):
        return None


def start(run_dir, *overrides):
    return start_run(run_dir, "--max-restarts", "2", "controller.mode=sync", *overrides)


def kill_env_when(run_dir, ready, old_pid=None, proc=None, sig=signal.SIGKILL):
    def env_up():
        if proc is not None and proc.poll() is not None:  # the launcher ended: say why, do not wait on
            out, err = proc.communicate()
            raise AssertionError(f"the launcher exited {proc.returncode}:\n{out[-2000:]}\n{err[-3000:]}")
        return ready() and env_pid(run_dir) not in (None, old_pid)

    wait_until(env_up, 400, 0.1)
    pid = env_pid(run_dir)
    os.kill(pid, sig)
    return pid


@pytest.mark.mpi
@pytest.mark.slow
def test_killed_rank_is_restarted_from_its_checkpoint(tmp_path):
    run_dir = tmp_path / "restarted"
    proc = start(run_dir, "controller.num_steps=4", "controller.checkpoint_every_steps=1")
    try:
        kill_env_when(
            run_dir, lambda: ckpt.latest(run_dir) is not None and len(metric_lines(run_dir)) >= 2, proc=proc
        )
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    rows = read_restarts(run_dir)
    # The killed env rank is named unless mpiexec ended a peer within the same launcher poll (20 ms).
    assert len(rows) == 1 and re.fullmatch(
        r"rank \d \(\w+\) died without reporting an error", rows[0]["cause"]
    )
    assert rows[0]["step"] >= 1 and "restart 1/2 from step" in out
    summary = read_summary(run_dir)
    records = stored_records(run_dir)
    assert summary["balanced"] and len({r.episode_id for r in records}) == len(records)
    assert sum(r.final_status == "trained" for r in records) == 4 * 4 == summary["accounting"]["trained"]


@pytest.mark.mpi
@pytest.mark.slow
def test_failure_repeating_at_the_same_step_stops_restarts(tmp_path):
    run_dir = tmp_path / "repeating"
    proc = start(
        run_dir, "controller.num_steps=60", "controller.checkpoint_every_steps=0"
    )  # killed long before the end
    try:
        first = kill_env_when(run_dir, lambda: len(metric_lines(run_dir)) >= 1, proc=proc)
        wait_until(lambda: (run_dir / RESTARTS).exists(), 400, 0.1)
        kill_env_when(run_dir, lambda: True, old_pid=first, proc=proc)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-3000:] + err[-3000:]
    assert "not restarting: the same failure repeated at step 0" in err, err[-3000:]
    assert len(read_restarts(run_dir)) == 1


@pytest.mark.mpi
@pytest.mark.slow
def test_a_crashed_rank_prints_its_python_stack(tmp_path):
    """A rank that dies on a fatal signal (here SIGSEGV, as a native crash would) prints the Python stack of
    each of its threads on stderr, so the console says where it crashed; the run fails."""
    run_dir = tmp_path / "crashed"
    proc = start_run(run_dir, "controller.mode=sync", "controller.num_steps=60")
    try:
        kill_env_when(run_dir, lambda: len(metric_lines(run_dir)) >= 1, proc=proc, sig=signal.SIGSEGV)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-2000:] + err[-3000:]
    _, sep, stack = err.partition("Fatal Python error: Segmentation fault")
    assert sep and re.search(r'File "[^"]*/rollart_hpc/[^"]+\.py", line \d+ in \w+', stack), err[-4000:]


def test_slurm_step_restart_records_rows_and_stops_on_a_repeat_or_when_spent(tmp_path, capsys):
    from rollart_hpc.cluster.restarts import restart_after_failed_step as policy
    from rollart_hpc.config import load_config, write_resolved
    from rollart_hpc.entry.restarts import check_resumable_run, job_script_main

    def restart_after_failed_step(run_dir, status, max_restarts):
        return policy(run_dir, status, max_restarts, check_resumable_run, checkpoint_step)

    write_resolved(load_config(REPO / "configs" / "tiny.toml"), tmp_path)
    assert job_script_main([str(tmp_path), "0", "2"]) == 1  # the step succeeded: nothing to restart
    assert restart_after_failed_step(tmp_path, 137, 2)
    assert not restart_after_failed_step(tmp_path, 137, 2)  # same cause, same checkpoint step
    assert "same failure repeated at step 0" in capsys.readouterr().out
    (tmp_path / "failures").mkdir()
    report = {"rank": 2, "role": "env", "message": "boom", "time": 1.0}
    (tmp_path / "failures" / "rank-2.json").write_text(json.dumps(report))
    assert restart_after_failed_step(tmp_path, 1, 2) and not (tmp_path / "failures").exists()
    assert [r["cause"] for r in read_restarts(tmp_path)] == [
        "the srun step exited with status 137 (a rank was killed or crashed)",
        "rank 2 (env) failed: boom",
    ]
    assert not restart_after_failed_step(tmp_path, 9, 2)  # 2 of 2 used
    assert "2 of 2 restarts used" in capsys.readouterr().out


def test_a_submitit_jobs_failure_requeues_do_not_use_its_stop_requeues(tmp_path, monkeypatch, capsys):
    """A submitit job restarts after a failure by a requeue, which SLURM counts in SLURM_RESTART_COUNT like
    the requeues after a stop at a checkpoint; only the latter count against --max-requeues, and their
    number in the log starts at 1 whatever failures came before (as in a hetjob)."""
    from fake_slurm import FakeSlurm

    from rollart_hpc.cluster import slurm
    from rollart_hpc.cluster.submission import requeue_after_stop
    from rollart_hpc.config import load_config, write_resolved
    from rollart_hpc.entry.restarts import job_script_main

    write_resolved(load_config(REPO / "configs" / "tiny.toml"), tmp_path)
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    fake = FakeSlurm({"scontrol requeue": (0, "", "")})
    previous = slurm.set_runner(fake)
    try:
        assert job_script_main([str(tmp_path), "139", "2", "--requeue"]) == 0  # a rank crashed
        assert fake.calls == [["scontrol", "requeue", "77"]]
        assert read_restarts(tmp_path)[0]["requeued_job"] == "77"
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the crash's requeue
        with pytest.raises(SystemExit):
            requeue_after_stop(tmp_path, 1)
        assert "requeue job 77 (restart 1 of 1)" in capsys.readouterr().out
        assert fake.calls[-1] == ["scontrol", "requeue", "77"]
        monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # and the stop's
        with pytest.raises(RuntimeError, match="1 of 1 requeues are used"):
            requeue_after_stop(tmp_path, 1)
        monkeypatch.setenv("SLURM_JOB_ID", "78")  # another job of the run: the rows are not its requeues
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        with pytest.raises(RuntimeError, match="1 of 1 requeues are used"):
            requeue_after_stop(tmp_path, 1)
    finally:
        slurm.set_runner(previous)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    capsys.readouterr()
    refused = FakeSlurm({"scontrol requeue": (1, "", "Requested operation is presently disabled\n")})
    previous = slurm.set_runner(refused)
    try:  # another failure: its restart is recorded, the requeue refused; one line, and no exit 0
        assert job_script_main([str(tmp_path), "1", "2", "--requeue"]) == 2
    finally:
        slurm.set_runner(previous)
    assert capsys.readouterr().err == (
        "error: scontrol requeue 78 failed: Requested operation is presently disabled\n"
    )
    assert len(read_restarts(tmp_path)) == 2
    monkeypatch.delenv("SLURM_JOB_ID")
    assert job_script_main([str(tmp_path), "139", "2", "--requeue"]) == 2
    assert capsys.readouterr().err == "error: --requeue outside a SLURM job\n"
    assert len(read_restarts(tmp_path)) == 2  # nothing recorded for a restart that cannot requeue
