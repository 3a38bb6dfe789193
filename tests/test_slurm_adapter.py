"""The one SLURM adapter (`cluster/slurm.py`): every scheduler command goes through it, its answers are parsed
in one place, and a refusal is one line. Runs against `FakeSlurm`; the slurm-marked tests run it for real."""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from fake_slurm import FakeSlurm

from rollart_hpc.cluster import slurm
from rollart_hpc.contracts.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {"sbatch", "squeue", "scancel", "sinfo", "scontrol", "sacct"}


@pytest.fixture
def fake() -> Iterator[FakeSlurm]:
    fake = FakeSlurm({})
    previous = slurm.set_runner(fake)
    yield fake
    slurm.set_runner(previous)


def test_partitions_nodes_and_gpus_are_parsed_from_sinfo(fake: FakeSlurm) -> None:
    fake.answers["sinfo -h -N -o %N %P"] = (0, "n1 debug*\nn2 debug*\nn2 gpu\n", "")
    fake.answers["sinfo -h -N -o %P %G"] = (0, "debug* (null)\ngpu gpu:h100:8(S:0-1)\ngpu gpu:4\n", "")
    fake.answers["sinfo -h -N -o %N %c"] = (0, "n1 4\nn2 8\n", "")
    assert slurm.partition_nodes() == {"debug": ["n1", "n2"], "": ["n1", "n2"], "gpu": ["n2"]}
    assert slurm.partition_gpus() == {"debug": 0, "": 0, "gpu": 8}
    assert slurm.node_cpus() == {"n1": 4, "n2": 8}


def test_failures_are_one_line(fake: FakeSlurm) -> None:
    fake.answers["sbatch"] = (1, "", "sbatch: error: Batch job submission failed: Invalid partition name\n")
    with pytest.raises(
        UsageError, match=r"^sbatch refused job.sbatch: sbatch: error: .*Invalid partition name$"
    ):
        slurm.sbatch("job.sbatch")
    with pytest.raises(UsageError, match="^sinfo failed: sinfo: command not found$"):
        slurm.partition_nodes()
    assert slurm.node_cpus() is None  # optional reads give up quietly
    assert fake.calls[0] == ["sbatch", "--parsable", "job.sbatch"]
    fake.answers["scontrol requeue"] = (1, "", "scontrol: error: Job has already finished\n\nfor job 7\n")
    with pytest.raises(slurm.SchedulerError) as refused:
        slurm.requeue("7")
    assert (
        str(refused.value)
        == "scontrol requeue 7 failed: scontrol: error: Job has already finished; for job 7"
    )


def test_a_command_that_does_not_answer_is_one_line() -> None:
    def hangs(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(list(argv), timeout_s)

    previous = slurm.set_runner(hangs)
    try:
        with pytest.raises(slurm.SchedulerError, match="^scontrol requeue 7 failed: Command .* timed out"):
            slurm.requeue("7")
        assert slurm.job_steps("7") is None
    finally:
        slurm.set_runner(previous)


def test_jobs_submitted_watched_and_requeued(fake: FakeSlurm) -> None:
    fake.answers["sbatch"] = (0, "4242;cluster\n", "")
    fake.answers["squeue -h -j"] = lambda argv: (
        (0, "RUNNING\n", "")
        if argv[3] == "4242"
        else (1, "", "slurm_load_jobs error: Invalid job id specified")
    )
    fake.answers["squeue --steps"] = (0, "4242.0\n4242.batch\n", "")
    fake.answers["scontrol requeue"] = (0, "", "")
    assert slurm.sbatch("job.sbatch") == "4242"
    assert slurm.job_state("4242") == "RUNNING" and slurm.job_state("17") is None
    assert slurm.job_steps("4242") == ["4242.0", "4242.batch"]
    slurm.requeue("4242")
    assert fake.calls[-1] == ["scontrol", "requeue", "4242"]


def _command_literals(path: Path) -> Iterator[tuple[int, str]]:
    """Scheduler commands a module starts itself: a list or tuple whose first item is a command's name."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.List | ast.Tuple) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in COMMANDS:
                yield node.lineno, str(first.value)


def test_no_module_but_the_adapter_calls_the_scheduler() -> None:
    adapter = REPO / "rollart_hpc" / "cluster" / "slurm.py"
    found = [
        f"{path.relative_to(REPO)}:{line} runs {command}"
        for path in sorted((REPO / "rollart_hpc").rglob("*.py"))
        if path != adapter
        for line, command in _command_literals(path)
    ]
    assert not found, "scheduler commands go through rollart_hpc/cluster/slurm.py:\n" + "\n".join(found)
    assert any(True for _ in _command_literals(adapter))
