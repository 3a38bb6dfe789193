"""The srun watchdog of the job scripts: an srun still alive `grace` seconds after slurmctld stopped
listing its step is killed; an srun that exits by itself, a step not yet started, or a slurmctld that
does not answer, leave it alone. A real child process stands in for srun and a scripted step list for
squeue (the hang itself is Slurm's, intermittent); `squeue_steps` runs against the real SLURM cluster
in the slurm-marked job tests."""

import json
import subprocess
import sys
import time

from rollart_hpc.cluster import srun_watch
from rollart_hpc.cluster.procs import rank_exit_path, ranks_finished
from rollart_hpc.cluster.srun_watch import srun_steps, watch


def sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def scripted(*answers):
    """A step lister that plays back `answers`, then repeats the last one."""
    answers = list(answers)

    def steps():
        return answers.pop(0) if len(answers) > 1 else answers[0]

    return steps


def squeue_playing(*answers):
    """A stand-in for `squeue_steps(job_id)` that plays back `answers` like `scripted`."""
    steps = scripted(*answers)
    return lambda job_id: steps()


def test_an_srun_outliving_its_step_is_killed_after_the_grace():
    proc = sleeper(60)
    start = time.monotonic()
    assert watch(proc.pid, scripted([], ["88.0"], ["88.0"], None, []), grace_s=0.5, poll_s=0.05)
    assert proc.wait(timeout=10) == -9
    assert 0.5 <= time.monotonic() - start < 10


def test_an_srun_that_exits_or_whose_step_never_showed_is_left_alone():
    proc = sleeper(1.0)
    assert not watch(proc.pid, scripted([]), grace_s=0.2, poll_s=0.05)  # never listed: not started
    assert proc.wait(timeout=10) == 0
    proc = sleeper(1.0)
    assert not watch(proc.pid, scripted(["88.0"], None), grace_s=0.2, poll_s=0.05)  # squeue failing
    assert proc.wait(timeout=10) == 0


def test_only_the_jobs_srun_steps_count():
    listed = ["88.batch", "88.extern", "88.0", "89.0", "88+0.1", "188.2", "88+1.0"]
    assert srun_steps("88", listed) == ["88.0", "88+0.1"]
    assert srun_steps("88", ["88.batch"]) == []


def test_a_killed_srun_counts_as_finished_only_when_every_rank_wrote_its_exit_record(tmp_path, monkeypatch):
    (tmp_path / "pids").mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "88")
    monkeypatch.setattr(srun_watch, "squeue_steps", squeue_playing(["88.0"], []))
    for rank in range(2):
        rank_exit_path(tmp_path, rank).write_text(json.dumps({"code": 0, "time": time.time() + 1}))
    args = ["--grace-s", "0.2", "--poll-s", "0.05", "--run-dir", str(tmp_path), "--ranks"]
    proc = sleeper(60)
    assert srun_watch.main([str(proc.pid), *args, "2"]) == srun_watch.STEP_FINISHED
    assert proc.wait(timeout=10) == -9
    proc = sleeper(60)  # rank 2 never finished
    monkeypatch.setattr(srun_watch, "squeue_steps", squeue_playing(["88.0"], []))
    assert srun_watch.main([str(proc.pid), *args, "3"]) == 1
    proc.wait(timeout=10)
    rank_exit_path(tmp_path, 1).write_text(json.dumps({"code": 0, "time": 1.0}))  # an earlier step's
    assert not ranks_finished(tmp_path, 2, since=time.time())
    rank_exit_path(tmp_path, 1).write_text("{trunc")
    assert not ranks_finished(tmp_path, 2, since=0.0)
