"""A run as one SLURM job: the submission behind `launch.py submit` (`rollart_hpc/entry/submit.py`).

Roles map to partitions by `roles.<role>.partition`:
- one partition (or none set): one job through submitit; every srun task runs the task the command gives
  (this rank's worker for the run dir, in submitit's task process), with `slurm/mpi_env.sh` sourced in the
  job's setup.
- several partitions: a heterogeneous job rendered from `slurm/templates/hetjob.sbatch.in` (see
  `rollart_hpc.cluster.sbatch`), submitted with `sbatch`; one `srun --het-group` step is the MPI world.
After submission `run_dir/slurm_job.json` (written atomically) records the job id, mode and log paths.
A dry run prints the job and, as `#` comment lines, every rank's predicted node and device
(`cluster.placement`); with `out` it writes the script (for a single partition too: one component, no
submitit) and prepares the run dir instead, for `sbatch FILE`. A job that asks a partition for more GPUs
per node than its nodes have is refused before sbatch, in one line. So is a run whose memory plan
(`rollart_hpc.plan.ranks`, computed by the command) does not fit some rank's GPU; a dry run prints that
plan after the job. `requeue_after_stop` requeues a submitit job whose world stopped at a checkpoint.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_hpc.cluster import slurm
from rollart_hpc.cluster.jobs import JOB_RECORD, job_record, prepare_run_dir, require_slurm, sbatch
from rollart_hpc.contracts.errors import UsageError

if TYPE_CHECKING:
    from rollart_hpc.cluster.plan import RunPlan
    from rollart_hpc.cluster.sbatch import HetComponent, JobSpec


def requeue_after_stop(run_dir: Path, max_requeues: int) -> None:
    """The world stopped at a checkpoint: the task of global rank 0 requeues the job and exits without a
    result (SystemExit); the other tasks return. With no requeue left, rank 0 raises RuntimeError.
    Only requeues after a stop count against `max_requeues`: SLURM_RESTART_COUNT less the job's requeues
    after a failure (`cluster.max_restarts` bounds those), as in a hetjob, whose failures restart within
    the allocation."""
    from rollart_hpc.cluster.env import read_process_env
    from rollart_hpc.cluster.restarts import failure_requeues

    env = read_process_env()
    if env.launcher_rank != 0:
        return
    if env.slurm_job_id is None:
        raise RuntimeError(f"the run in {run_dir} stopped at a checkpoint outside SLURM: nothing to requeue")
    restarts = env.slurm_restart_count - failure_requeues(run_dir, env.slurm_job_id)
    if restarts >= max_requeues:
        raise RuntimeError(
            f"the run in {run_dir} stopped at a checkpoint, and {restarts} of {max_requeues} requeues are "
            f"used: not requeued; continue it with 'scontrol requeue {env.slurm_job_id}'"
        )
    print(
        f"[slurm] the run stopped at a checkpoint: requeue job {env.slurm_job_id} "
        f"(restart {restarts + 1} of {max_requeues})",
        flush=True,
    )
    slurm.requeue(env.slurm_job_id)
    raise SystemExit(0)


def check_own_code(config: Any) -> None:
    """The run's own families, reward functions and task files, checked before anything is submitted."""
    from rollart_hpc.tasks.checks import check_own_code as check

    for line in check(config.envs, config.reward, config.run.python_path):
        print(line, flush=True)


@dataclass(frozen=True)
class JobRequest:
    """One run's job as `launch.py submit` asks for it: `spec` for `plan` and `config`; `nodes` of a
    single-partition job; `dry_run` shows the job instead (with `out`, writes its script there and prepares
    the run dir); `task` is what every srun task of a submitit job runs; `memory` the run's memory plan
    (its table, and its refusal line or None)."""

    spec: JobSpec
    plan: RunPlan
    config: Any
    nodes: int
    dry_run: bool
    out: str | None
    task: Callable[[], int]
    memory: tuple[str, str | None]


def submit_job(request: JobRequest) -> int:
    """Submit (or show) the job: a hetjob when the roles sit on several partitions or rollout pools, else
    one submitit job. A run whose memory plan does not fit is refused (after a dry run has shown the job
    and its memory plan)."""
    from rollart_hpc.cluster.sbatch import plan_partitions

    plan, refusal = request.plan, request.memory[1]
    if refusal and (not request.dry_run or request.out):
        raise UsageError(refusal)
    if len(plan_partitions(plan)) > 1 or len(plan.pools()) > 1:  # each rollout pool: a component
        if request.nodes != 1:
            raise UsageError(
                "--nodes applies to single-partition jobs; hetjob components get nodes from SLURM"
            )
        code = submit_hetjob(request)
    else:
        code = submit_single(request)
    if refusal:  # a dry run has shown the job and its memory plan
        raise UsageError(refusal)
    return code


def submit_hetjob(request: JobRequest) -> int:
    from rollart_hpc.cluster.sbatch import (
        HETJOB_SCRIPT,
        check_components_fit,
        check_gpus_fit,
        het_components,
        render_hetjob,
    )
    from rollart_hpc.contracts.atomic import atomic_write_bytes

    spec, plan = request.spec, request.plan
    components = het_components(plan)
    script = render_hetjob(spec, components)
    if request.dry_run:
        return show_dry_run(request, components, script)
    require_slurm()
    check_components_fit(components, slurm.partition_nodes())
    check_gpus_fit(components, slurm.partition_gpus())
    prepare_run_dir(request.config, spec.run_dir)
    script_path = spec.run_dir / HETJOB_SCRIPT
    atomic_write_bytes(script_path, script.encode())
    job_id = sbatch(script_path)
    log = str(spec.hetjob_output).replace("%j", job_id)
    record = job_record(spec, plan, "hetjob", job_id, [log])
    record["script"] = str(script_path)
    record["components"] = [
        {"partition": c.partition, "ranks": [c.start, c.start + c.num_ranks], "roles": list(c.roles)}
        for c in components
    ]
    return finish(spec, record)


def show_dry_run(request: JobRequest, components: tuple[HetComponent, ...], script: str | None) -> int:
    """Print (or with `out`, write and prepare the run dir for) the job with every rank's placement, then
    the memory plan."""
    from rollart_hpc.cluster.sbatch import render_job
    from rollart_hpc.contracts.atomic import atomic_write_bytes

    spec, plan, out = request.spec, request.plan, request.out
    memory = "".join(f"# {line}\n" for line in request.memory[0].splitlines())
    if out is None:
        print(job_text(plan, components, script or "") + memory, end="")
        return 0
    text = job_text(plan, components, script or render_job(spec, components))
    atomic_write_bytes(Path(out), text.encode())
    prepare_run_dir(request.config, spec.run_dir)
    print(text[text.index("# placement") :] + memory, end="")
    print(f"# wrote {Path(out).resolve()}; run dir {spec.run_dir} holds the resolved config")
    print(f"# submit it as is: sbatch {shlex.quote(str(Path(out).resolve()))}")
    return 0


def job_text(plan: RunPlan, components: tuple[HetComponent, ...], script: str) -> str:
    """The job script followed by every rank's predicted placement as comment lines (what dry runs show)."""
    from rollart_hpc.cluster.placement import check_distinct, placement_table, predict
    from rollart_hpc.cluster.sbatch import component_layout

    placements = predict(plan, component_layout(components), ())
    check_distinct(placements)
    return script + "".join(f"# {line}\n" for line in placement_table(placements).splitlines())


def submit_single(request: JobRequest) -> int:
    """One job through submitit whose every srun task runs `request.task` (or, in a dry run, its parameters
    printed)."""
    from rollart_hpc.cluster.sbatch import (
        check_gpus_fit,
        check_single_fit,
        single_component,
        submitit_parameters,
    )

    spec, plan, nodes = request.spec, request.plan, request.nodes
    params = submitit_parameters(spec, plan, nodes)
    component = single_component(plan, nodes)
    if request.dry_run:
        show_dry_run(request, (component,), None)
        if request.out is None:
            print(
                f"submitit SlurmExecutor(folder={str(spec.submitit_folder)!r}, max_num_timeout={spec.max_requeues})"
            )
            print(json.dumps(params, indent=1, sort_keys=True))
        return 0
    require_slurm()
    check_single_fit(params.get("partition", ""), nodes, slurm.partition_nodes())
    check_gpus_fit((component,), slurm.partition_gpus())
    prepare_run_dir(request.config, spec.run_dir)
    job_id, logs = submitit_submit(spec, params, request.task)
    record = job_record(spec, plan, "submitit", job_id, logs)
    record["submitit_parameters"] = params
    return finish(spec, record)


def submitit_submit(spec: JobSpec, params: dict[str, Any], task: Callable[[], int]) -> tuple[str, list[str]]:
    import submitit

    executor = submitit.SlurmExecutor(folder=spec.submitit_folder, max_num_timeout=spec.max_requeues)
    executor.update_parameters(**params)
    job = executor.submit(task)
    return str(job.job_id), [str(job.paths.stdout), str(job.paths.stderr)]


def finish(spec: JobSpec, record: dict[str, Any]) -> int:
    from rollart_hpc.contracts.atomic import atomic_write_json

    atomic_write_json(spec.run_dir / JOB_RECORD, record)
    print(f"submitted job {record['job_id']} ({record['mode']}, {record['world_size']} ranks)")
    print(f"run dir {spec.run_dir}")
    for log in record["logs"]:
        print(f"log {log}")
    print(f"rank logs {spec.run_dir / 'logs'}/rank-<r>.log", file=sys.stdout, flush=True)
    return 0
