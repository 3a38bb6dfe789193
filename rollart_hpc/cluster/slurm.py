"""The one SLURM adapter: every scheduler command of the system (sbatch, squeue, sinfo, scontrol) goes
through here, as one function per question, with a timeout and a one-line error.

`RUNNER` executes the commands (`subprocess.run`); tests swap it for a fake that records each command and
answers it (`set_runner`). `srun` itself is started by the job scripts, not from Python.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence

from rollart_hpc.contracts.errors import UsageError

COMMAND_TIMEOUT_S = 60.0
Runner = Callable[[Sequence[str], float], subprocess.CompletedProcess[str]]


def _subprocess_runner(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)


RUNNER: Runner = _subprocess_runner


def set_runner(runner: Runner | None) -> Runner:
    """Use `runner` for every command from now on (None: the real one); returns the previous runner."""
    global RUNNER
    previous, RUNNER = RUNNER, runner or _subprocess_runner
    return previous


def run(argv: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """One scheduler command through the current runner."""
    return RUNNER(argv, timeout_s)


class SchedulerError(RuntimeError):
    """A scheduler command that failed or did not answer in time; its message is one line naming the command."""


def _run_or_raise(
    argv: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """`run`, with a command that did not start or did not answer in time as a SchedulerError."""
    try:
        return run(argv, timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SchedulerError(f"{' '.join(argv)} failed: {exc}") from exc


def _said(proc: subprocess.CompletedProcess[str]) -> str:
    """What a failed command said (stderr, else stdout), its lines joined into one."""
    return "; ".join(line.strip() for line in (proc.stderr or proc.stdout or "").splitlines() if line.strip())


def require_tools(*tools: str, why: str) -> None:
    """UsageError naming the first of `tools` that is not on PATH."""
    for tool in tools:
        if shutil.which(tool) is None:
            raise UsageError(f"{tool} not found: {why}")


def sbatch_command(script_path: str) -> list[str]:
    """The command line that submits `script_path` and prints the job id alone (for deferred submissions)."""
    return ["sbatch", "--parsable", script_path]


def sbatch(script_path: str) -> str:
    """Submit a script; returns the job id. A refusal by sbatch is a one-line UsageError."""
    proc = run(sbatch_command(script_path))
    if proc.returncode != 0:
        raise UsageError(f"sbatch refused {script_path}: {_said(proc)}")
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch printed no job id: {proc.stdout!r}")
    return job_id


def job_state(job_id: str) -> str | None:
    """The job's state while squeue lists it, None once it left the queue. An squeue that fails for another
    reason raises (a caller that cannot tell must not submit a second job)."""
    proc = run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None
        raise SchedulerError(f"squeue -j {job_id} failed: {_said(proc)}")
    return proc.stdout.strip() or None


def job_steps(job_id: str, timeout_s: float = 30.0) -> list[str] | None:
    """The step ids squeue lists for the job now; None when squeue fails or does not answer in time."""
    try:
        proc = run(["squeue", "--steps", "--noheader", "--format=%i", "--jobs", job_id], timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.split() if proc.returncode == 0 else None


def requeue(job_id: str) -> None:
    """`scontrol requeue` the job (same id); a failure raises SchedulerError naming the job."""
    proc = _run_or_raise(["scontrol", "requeue", job_id])
    if proc.returncode != 0:
        raise SchedulerError(f"scontrol requeue {job_id} failed: {_said(proc)}")


def node_rows(fields: str, *, required: bool = True) -> list[list[str]] | None:
    """`sinfo -h -N -o FIELDS` split into rows of whitespace-separated columns. When sinfo fails: a one-line
    UsageError with what it said, or None when not `required`."""
    proc = run(["sinfo", "-h", "-N", "-o", fields])
    if proc.returncode != 0:
        if required:
            raise UsageError(f"sinfo failed: {_said(proc)}")
        return None
    return [line.split() for line in proc.stdout.splitlines() if line.strip()]


def partition_nodes() -> dict[str, list[str]]:
    """Nodes of every partition; the default partition is also listed under ''."""
    nodes: dict[str, list[str]] = {}
    for node, partition in (row for row in node_rows("%N %P") or [] if len(row) == 2):
        for name in [partition.rstrip("*")] + ([""] if partition.endswith("*") else []):
            if node not in nodes.setdefault(name, []):
                nodes[name].append(node)
    return nodes


def partition_gpus() -> dict[str, int]:
    """The most GPUs one node of each partition has (sinfo's gres); the default partition also as ''."""
    gpus: dict[str, int] = {}
    for row in node_rows("%P %G") or []:
        partition, gres = row[0], " ".join(row[1:])
        count = sum(int(g.split("(")[0].split(":")[-1]) for g in gres.split(",") if g.startswith("gpu:"))
        for name in [partition.rstrip("*")] + ([""] if partition.endswith("*") else []):
            gpus[name] = max(gpus.get(name, 0), count)
    return gpus


def node_cpus() -> dict[str, int] | None:
    """CPUs of every node; None when sinfo fails."""
    rows = node_rows("%N %c", required=False)
    return None if rows is None else {row[0]: int(row[1]) for row in rows if len(row) == 2}
