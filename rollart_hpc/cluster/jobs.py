"""One run as a SLURM job: its `JobSpec` from the config, the run directory prepared for it, the
submission, and the record of the submitted job (`RUN_DIR/slurm_job.json`). Used by `launch.py submit`
and by sweeps submitted as a job array."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_hpc.cluster import slurm
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout

if TYPE_CHECKING:
    from rollart_hpc.cluster.plan import RunPlan
    from rollart_hpc.cluster.sbatch import JobSpec
    from rollart_hpc.config.schema import Config

JOB_RECORD = "slurm_job.json"


def job_spec(config: Config, run_dir: Path, time_min: int, max_requeues: int) -> JobSpec:
    """The job of one run of `config` in `run_dir` (restarts, stop signal lead, network settings and
    finish marker from the config)."""
    from rollart_hpc.cluster.sbatch import JobSpec

    check_signal_lead(config.cluster.signal_lead_s, time_min)
    return JobSpec(
        config.run.name,
        run_dir,
        time_min,
        max_requeues,
        signal_delay_s=config.cluster.signal_lead_s,
        max_restarts=config.cluster.max_restarts,
        job=config.run.job,
        env=tuple(config.cluster.net.environment().items()),
    )


def check_signal_lead(signal_lead_s: int, time_min: int) -> None:
    """The stop signal must come before the time limit, or the job is signalled as soon as it starts."""
    if signal_lead_s >= time_min * 60:
        raise UsageError(
            f"cluster.signal_lead_s: {signal_lead_s} s is not below the time limit (--time-min {time_min})"
        )


def require_slurm() -> None:
    slurm.require_tools("sbatch", "srun", why="submit needs a SLURM client (--dry-run works without one)")


def prepare_run_dir(config: Any, run_dir: Path) -> None:
    """Write the resolved config; drop failure records of an earlier attempt in the same run dir."""
    from rollart_hpc.config import write_resolved

    if RunLayout(run_dir).failures.exists():
        shutil.rmtree(RunLayout(run_dir).failures)
    write_resolved(config, run_dir)


def sbatch(script_path: Path) -> str:
    """Submit a script; returns the job id. A refusal by sbatch is reported as a usage error."""
    return slurm.sbatch(str(script_path))


def job_record(spec: JobSpec, plan: RunPlan, mode: str, job_id: str, logs: list[str]) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "mode": mode,
        "name": spec.name,
        "run_dir": str(spec.run_dir),
        "world_size": plan.world_size,
        "logs": logs,
        "submitted_at": time.time(),
    }
