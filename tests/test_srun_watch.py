"""The srun watchdog of the job scripts: an srun still alive `grace` seconds after slurmctld stopped
listing its step is killed; an srun that exits by itself, a step not yet started, or a slurmctld that
does not answer, leave it alone. A real child process stands in for srun and a scripted step list for
squeue (the hang itself is Slurm's, intermittent); `squeue_steps` runs against the real SLURM cluster
in the slurm-marked job tests."""

import subprocess
import sys
import time

from rollart_hpc.cluster.srun_watch import srun_steps, watch


def sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def scripted(*answers):
    """A step lister that plays back `answers`, then repeats the last one."""
    answers = list(answers)

    def steps():
        return answers.pop(0) if len(answers) > 1 else answers[0]

    return steps


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
