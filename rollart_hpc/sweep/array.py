"""A sweep as one SLURM job array: every run one element on one partition (SLURM has no arrays of
heterogeneous jobs), its resources checked against the partition, the submitted array recorded in
`DIR/sweep.json`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_hpc.cluster import slurm
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.sweep.grid import RESUME, SWEEP_JSON, SweepRun

if TYPE_CHECKING:
    from rollart_hpc.cluster.sbatch import HetComponent
    from rollart_hpc.config.schema import Config

ARRAY_SCRIPT = "array.sbatch"


@dataclass(frozen=True)
class ArrayOptions:
    """A sweep's job array: nodes and minutes per element, requeues after a stop, and the check of a run
    to resume (its model, checkpoint and store, before anything changes)."""

    nodes: int
    time_min: int
    max_requeues: int
    check_resumable: Callable[[Path, Config], None]


def array_component(config: Config, nodes: int) -> HetComponent:
    """The run's world as one job component; UsageError when its roles sit on several partitions."""
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.cluster.sbatch import plan_partitions, single_component

    plan = make_plan(config.roles)
    partitions = plan_partitions(plan)
    if len(partitions) > 1:
        raise UsageError(
            f"--slurm runs each run as one job array element, which cannot be a heterogeneous job; the roles "
            f"sit on partitions {', '.join(repr(p) for p in partitions)}: put every role on one partition "
            f"(e.g. --set roles.<role>.partition=...)"
        )
    return single_component(plan, nodes)


def check_cpus_fit(component: HetComponent, nodes: Sequence[str]) -> None:
    """UsageError when the element's tasks need more CPUs than its partition's nodes have together (sbatch
    would accept the array and leave it pending for ever)."""
    cpus = slurm.node_cpus()
    if cpus is None:
        return
    have = sum(cpus.get(node, 0) for node in nodes)
    need = component.num_ranks * max(component.cpus_per_task, 1)
    if need > have:
        where = repr(component.partition) if component.partition else "(default)"
        raise UsageError(
            f"each run needs {need} CPUs ({component.num_ranks} ranks), and partition {where} has {have}: "
            f"put the roles on a larger partition (--set roles.<role>.partition=...)"
        )


def record_array(out: Path, job_id: str, todo: Sequence[SweepRun]) -> None:
    """Append the submitted array (job id, element -> run) to DIR/sweep.json."""
    from rollart_hpc.contracts.atomic import atomic_write_json

    data = json.loads((out / SWEEP_JSON).read_text())
    entry = {"job_id": job_id, "script": str(out / ARRAY_SCRIPT), "elements": [r.name for r in todo]}
    data["slurm"] = [*data.get("slurm", []), {**entry, "submitted_at": time.time()}]
    atomic_write_json(out / SWEEP_JSON, data)


def submit_array(
    out: Path,
    todo: Sequence[SweepRun],
    configs: dict[str, Config],
    states: dict[str, str],
    options: ArrayOptions,
) -> int:
    """Prepare every run dir with its single-component job script, then sbatch one array over them; a
    run to resume is first checked by `options.check_resumable`."""
    from rollart_hpc.cluster.jobs import JOB_RECORD, job_record, job_spec, prepare_run_dir, require_slurm
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.cluster.sbatch import (
        check_gpus_fit,
        check_single_fit,
        render_array_job,
        render_job,
    )
    from rollart_hpc.contracts.atomic import atomic_write_bytes, atomic_write_json

    components = {r.name: array_component(configs[r.name], options.nodes) for r in todo}
    first = components[todo[0].name]
    for run in todo:
        if components[run.name] != first:
            raise UsageError(
                f"runs of one job array ask the same resources; {run.name} asks "
                f"{components[run.name].describe()}, {todo[0].name} {first.describe()}"
            )
    require_slurm()
    nodes_by_partition = slurm.partition_nodes()
    check_single_fit(first.partition, options.nodes, nodes_by_partition)
    check_cpus_fit(first, nodes_by_partition[first.partition])
    check_gpus_fit((first,), slurm.partition_gpus())
    specs = {}
    for run in todo:
        config, run_dir = configs[run.name], out / run.name
        spec = job_spec(config, run_dir, options.time_min, options.max_requeues)
        if states[run.name] == RESUME:
            options.check_resumable(run_dir, config)
        prepare_run_dir(config, run_dir)  # the same config (resolve_runs checked it); drops failures/
        atomic_write_bytes(RunLayout(run_dir).job_script, render_job(spec, (first,)).encode())
        specs[run.name] = spec
    name = f"{configs[todo[0].name].run.name}-sweep"
    script = render_array_job(
        name, out, [out / r.name for r in todo], first, options.time_min, specs[todo[0].name].signal_delay_s
    )
    atomic_write_bytes(out / ARRAY_SCRIPT, script.encode())
    job_id = slurm.sbatch(str(out / ARRAY_SCRIPT))
    record_array(out, job_id, todo)
    for index, run in enumerate(todo):
        plan = make_plan(configs[run.name].roles)
        record = job_record(specs[run.name], plan, "array", f"{job_id}_{index}", [])
        atomic_write_json(out / run.name / JOB_RECORD, record)
    print(f"submitted job array {job_id} ({len(todo)} elements, script {out / ARRAY_SCRIPT})", flush=True)
    for index, run in enumerate(todo):
        print(f"  {job_id}_{index}: {run.name} (log {out / run.name}/slurm-<element job id>.out)", flush=True)
    return 0
