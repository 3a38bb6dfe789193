"""What `launch.py submit` hands to SLURM for a run plan: hetjob sbatch scripts and submitit parameters.

Pure rendering: no subprocess, no SLURM client, no submitit import, so every output is pinned by golden
files. Invariants of a rendered job:
- The hetjob components cover the plan's ranks in plan order with no gap: component i holds world
  ranks [start_i, start_i + num_ranks_i) and start_{i+1} = start_i + num_ranks_i. `srun --het-group=0,...,k`
  numbers the tasks of component 0 first, then component 1, ..., so MPI world rank == plan rank.
- Adjacent roles on the same partition share one component; roles with no ranks get none. Each named
  rollout pool (`roles.rollout_pools`) is a component of its own, whatever its neighbours' partitions.
- Resources (`roles.<role>.gpus_per_rank`, `cpus_per_rank`, `mem_gb`, `ranks_per_node`, `gpu_type`,
  `constraint`, `sbatch_extra`): a component spans `num_ranks / ranks_per_node` nodes in block order
  (`--nodes`, `--ntasks-per-node`; one node when no role sets ranks_per_node) and asks, per node, for the
  GPUs and memory of its busiest node (`--gres=gpu[:type]:G`, `--mem`), and per task for the most cores
  any of its roles asks (`--cpus-per-task`). Every task of a node sees the node's GPUs, and
  `cluster.placement` gives each rank its own. A component asks for nothing it was not told to.
- SLURM never lets two components of one heterogeneous job share a node (measured on Slurm 22.05: such a
  job stays pending), so a plan fits a cluster only if every component can get a node of its own
  from its partition; `check_components_fit` tests that before submitting.
- A job's finish marker (`FINISH_MARKERS`) tells a finished run from one stopped at a checkpoint when
  the step exits 0: the rendered script requeues only the latter, and only after the step has ended.
- Every value that comes from the user (run dir, run name, partition) is quoted with `shlex.quote`
  wherever it appears, in #SBATCH lines and in shell lines alike. Characters that SLURM reads specially
  in #SBATCH lines or file name patterns (`%`, backslash, newline) are refused in the run dir.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart_hpc.cluster.plan import RoleRange, RunPlan, set_parts
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_DIR = REPO_ROOT / "slurm" / "templates"
HETJOB_TEMPLATE = "hetjob.sbatch.in"
MPI_ENV = REPO_ROOT / "slurm" / "mpi_env.sh"
PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
# Characters SLURM interprets in #SBATCH values (backslash escapes) or output file patterns (%j, ...).
REFUSED_IN_RUN_DIR = {"%": "percent sign", "\\": "backslash", "\n": "newline", "\r": "carriage return"}
SUBMITIT_FOLDER = "submitit"
HETJOB_SCRIPT = "job.sbatch"
HETJOB_OUTPUT = "slurm-%j.out"
# run.job -> the file a finished run of that job leaves in its run dir. None: the job has no checkpoints,
# so a step that exits 0 has finished it (a requeue would only start it over).
FINISH_MARKERS: dict[str, str | None] = {
    "rl": RunLayout.SUMMARY_NAME,
    "smoke": None,
    "eval": RunLayout.EVAL_RESULT_NAME,
}


@dataclass(frozen=True)
class HetComponent:
    """One `#SBATCH hetjob` component: a contiguous block of world ranks on one partition, and what it
    asks SLURM for (per node: GPUs, memory; per task: cores). `ranks_per_node` 0: one node."""

    partition: str
    start: int
    num_ranks: int
    roles: tuple[str, ...]
    ranks_per_node: int = 0
    gpus_per_node: int = 0
    cpus_per_task: int = 0
    mem_gb_per_node: int = 0
    gpu_type: str = ""
    constraint: str = ""
    extra: tuple[str, ...] = ()

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.num_ranks)

    @property
    def tasks_per_node(self) -> int:
        return self.ranks_per_node or self.num_ranks

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.tasks_per_node

    @property
    def pins_nodes(self) -> bool:
        """Whether the script states the node layout (needed for per-node GPU and memory requests)."""
        return bool(self.ranks_per_node or self.gpus_per_node or self.mem_gb_per_node)

    def node_of(self, rank: int) -> tuple[int, int]:
        """(node index within the component, local rank) of a world rank, in block order."""
        return divmod(rank - self.start, self.tasks_per_node)

    def describe(self) -> str:
        last = self.start + self.num_ranks - 1
        span = f"rank {self.start}" if last == self.start else f"ranks {self.start}-{last}"
        return (
            f"{span} on {self.partition or '(default partition)'}: {', '.join(self.roles)}{self.resources()}"
        )

    def resources(self) -> str:
        parts = set_parts(
            (self.pins_nodes, f"{self.num_nodes} node(s) x {self.tasks_per_node} tasks"),
            (self.gpus_per_node, f"{self.gpus_per_node} GPU(s)/node"),
            (self.cpus_per_task, f"{self.cpus_per_task} CPU(s)/task"),
            (self.mem_gb_per_node, f"{self.mem_gb_per_node}G/node"),
        )
        return f" ({', '.join(parts)})" if parts else ""


@dataclass(frozen=True)
class JobSpec:
    """What every submission of a run shares. `run_dir`, `python` and `mpi_env` are absolute paths;
    `job` is the run's `run.job` (a key of FINISH_MARKERS); `max_restarts` is `cluster.max_restarts`
    (restarts after a failed step, see `rollart_hpc.cluster.restarts`); `env` the (name, value) pairs
    exported to every rank (`cluster.net`)."""

    name: str
    run_dir: Path
    time_min: int
    max_requeues: int
    signal_delay_s: int = 60
    python: str = field(default_factory=lambda: sys.executable)
    mpi_env: Path = MPI_ENV
    max_restarts: int = 0
    job: str = field(kw_only=True)
    env: tuple[tuple[str, str], ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        if self.job not in FINISH_MARKERS:
            raise ValueError(
                f"job {self.job!r} has no finish marker; known jobs: {', '.join(FINISH_MARKERS)}"
            )

    @property
    def finish_marker(self) -> str | None:
        return FINISH_MARKERS[self.job]

    @property
    def hetjob_output(self) -> Path:
        return self.run_dir / HETJOB_OUTPUT

    @property
    def submitit_folder(self) -> Path:
        return self.run_dir / SUBMITIT_FOLDER


def het_components(plan: RunPlan) -> tuple[HetComponent, ...]:
    """Group the plan's rank ranges into contiguous components; adjacent equal partitions merge."""
    groups: list[list[RoleRange]] = []
    for role in plan.roles:
        if role.num_ranks == 0:
            continue
        if groups and groups[-1][-1].partition == role.partition and not (role.pool or groups[-1][-1].pool):
            groups[-1].append(role)
        else:
            groups.append([role])
    return tuple(make_component(plan, group) for group in groups)


def single_component(plan: RunPlan, nodes: int) -> HetComponent:
    """The whole world as one component on `nodes` nodes (a single-partition job)."""
    world = plan.world_size
    if nodes < 1 or world % nodes:
        raise UsageError(f"--nodes {nodes}: the world of {world} ranks must split evenly over the nodes")
    partitions = plan_partitions(plan)
    if len(partitions) > 1:
        raise ValueError(f"a single component runs one partition; the plan has {', '.join(partitions)}")
    roles = [r for r in plan.roles if r.num_ranks]
    for role in roles:
        if role.resources.ranks_per_node and role.resources.ranks_per_node != world // nodes:
            raise UsageError(
                f"roles.{role.role}.ranks_per_node: a single-partition job places {world // nodes} ranks per "
                f"node (--nodes {nodes}); leave it at 0"
            )
    return make_component(plan, roles, ranks_per_node=world // nodes if nodes > 1 else 0)


def _agreed(roles: list[RoleRange], name: str) -> Any:
    """The one non-empty value of a per-component field among `roles` (UsageError if two differ)."""
    values = {r.role: getattr(r.resources, name) for r in roles if getattr(r.resources, name)}
    if len(set(values.values())) > 1:
        listed = ", ".join(f"roles.{role}.{name} = {value!r}" for role, value in values.items())
        raise UsageError(
            f"{listed}: these roles share one job component (partition order), so set them equal"
        )
    return next(iter(values.values()), type(getattr(roles[0].resources, name))())


def make_component(plan: RunPlan, roles: list[RoleRange], ranks_per_node: int = 0) -> HetComponent:
    """A component of consecutive `roles`, with its per-node and per-task requests."""
    start, num = roles[0].start, sum(r.num_ranks for r in roles)
    per_node = ranks_per_node or _agreed(roles, "ranks_per_node") or num
    if num % per_node:
        names = ", ".join(r.role for r in roles)
        raise UsageError(
            f"roles {names} share a job component of {num} ranks, which do not fill nodes of {per_node}"
        )
    nodes = [range(start + i, start + i + per_node) for i in range(0, num, per_node)]

    def busiest(amount: str) -> int:
        return max(sum(getattr(plan.role_of(r).resources, amount) for r in node) for node in nodes)

    extra = tuple(dict.fromkeys(line for r in roles for line in r.resources.sbatch_extra))
    return HetComponent(
        roles[0].partition,
        start,
        num,
        tuple(f"rollout:{r.pool}" if r.pool else r.role for r in roles),
        ranks_per_node=ranks_per_node or _agreed(roles, "ranks_per_node"),
        gpus_per_node=busiest("gpus_per_rank"),
        cpus_per_task=max(r.resources.cpus_per_rank for r in roles),
        mem_gb_per_node=busiest("mem_gb"),
        gpu_type=_agreed(roles, "gpu_type"),
        constraint=_agreed(roles, "constraint"),
        extra=extra,
    )


def component_layout(components: tuple[HetComponent, ...]) -> Callable[[int], tuple[str, int]]:
    """rank -> (node label, local rank) of a job's components: 'train:c1n0' is node 0 of component 1."""

    def node_of(rank: int) -> tuple[str, int]:
        for index, component in enumerate(components):
            if rank in component.ranks:
                node, local = component.node_of(rank)
                return f"{component.partition or 'default'}:c{index}n{node}", local
        raise ValueError(f"rank {rank} is in no component")

    return node_of


def plan_partitions(plan: RunPlan) -> tuple[str, ...]:
    """Distinct partitions of the roles that have ranks, in plan order ('' = the cluster's default)."""
    seen: dict[str, None] = {}
    for role in plan.roles:
        if role.num_ranks:
            seen.setdefault(role.partition, None)
    return tuple(seen)


def unplaceable_components(
    components: tuple[HetComponent, ...], nodes_by_partition: Mapping[str, Sequence[str]]
) -> list[int]:
    """Indices of components left without a node of their own in a maximum matching (augmenting paths)."""
    owner: dict[str, int] = {}

    def place(index: int, seen: set[str]) -> bool:
        for node in nodes_by_partition.get(components[index].partition, ()):
            if node in seen:
                continue
            seen.add(node)
            if node not in owner or place(owner[node], seen):
                owner[node] = index
                return True
        return False

    return [index for index in range(len(components)) if not place(index, set())]


def check_components_fit(
    components: tuple[HetComponent, ...], nodes_by_partition: Mapping[str, Sequence[str]]
) -> None:
    """UsageError unless every component's partition exists and each component can get its own node."""
    for component in components:
        if component.partition not in nodes_by_partition:
            known = ", ".join(sorted(p for p in nodes_by_partition if p)) or "none"
            where = repr(component.partition) if component.partition else "(default)"
            raise UsageError(
                f"partition {where} of {', '.join(component.roles)} not found (partitions: {known})"
            )
    missing = unplaceable_components(components, nodes_by_partition)
    if missing:
        names = "; ".join(f"[{i}] {components[i].describe()}" for i in missing)
        raise UsageError(
            f"SLURM gives each hetjob component nodes of its own, and the partitions have too few nodes for "
            f"{len(components)} components; left without a node: {names}. Put adjacent roles on one partition."
        )


def check_single_fit(partition: str, nodes: int, nodes_by_partition: Mapping[str, Sequence[str]]) -> None:
    """UsageError unless `partition` ('' = the default) exists and has at least `nodes` nodes."""
    where = repr(partition) if partition else "(default)"
    if partition not in nodes_by_partition:
        known = ", ".join(sorted(p for p in nodes_by_partition if p)) or "none"
        raise UsageError(f"partition {where} not found (partitions: {known})")
    if len(nodes_by_partition[partition]) < nodes:
        raise UsageError(f"--nodes {nodes}: partition {where} has {len(nodes_by_partition[partition])} nodes")


def check_run_dir(run_dir: Path) -> None:
    """Refuse run dirs that SLURM would rewrite (file name patterns, #SBATCH escapes)."""
    for char, what in REFUSED_IN_RUN_DIR.items():
        if char in str(run_dir):
            raise UsageError(
                f"run dir {str(run_dir)!r} contains a {what}, which SLURM rewrites in paths; pick another"
            )


def fill_template(text: str, values: Mapping[str, str]) -> str:
    """Replace every `@NAME@` in one pass (inserted values are never scanned again)."""
    names = set(PLACEHOLDER.findall(text))
    if names != set(values):
        missing, unused = sorted(names - set(values)), sorted(set(values) - names)
        raise ValueError(f"template placeholders do not match: missing {missing}, unused {unused}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def component_lines(components: tuple[HetComponent, ...]) -> list[str]:
    """#SBATCH lines of every component, separated by `#SBATCH hetjob`."""
    lines: list[str] = []
    for index, component in enumerate(components):
        if index:
            lines.append("#SBATCH hetjob")
        lines.append(f"# component {index}: {component.describe()}")
        if component.partition:
            lines.append(f"#SBATCH --partition={shlex.quote(component.partition)}")
        lines.append(f"#SBATCH --ntasks={component.num_ranks}")
        lines.extend(f"#SBATCH {option}" for option in resource_options(component))
    return lines


def gres(component: HetComponent) -> str:
    """'gpu:h100:8' (the per-node GPU request), '' without GPUs."""
    if not component.gpus_per_node:
        return ""
    kind = f"{component.gpu_type}:" if component.gpu_type else ""
    return f"gpu:{kind}{component.gpus_per_node}"


def resource_options(component: HetComponent) -> list[str]:
    """sbatch options of a component's node layout and resources (none when it asks for nothing)."""
    options = set_parts(
        (component.pins_nodes, f"--nodes={component.num_nodes}"),
        (component.pins_nodes, f"--ntasks-per-node={component.tasks_per_node}"),
        (component.gpus_per_node, f"--gres={gres(component)}"),
        (component.cpus_per_task, f"--cpus-per-task={component.cpus_per_task}"),
        (component.mem_gb_per_node, f"--mem={component.mem_gb_per_node}G"),
        (component.constraint, f"--constraint={shlex.quote(component.constraint)}"),
    )
    for line in component.extra:
        key, sep, value = line.partition("=")
        options.append(f"{key}={shlex.quote(value)}" if sep else key)
    return options


def check_gpus_fit(components: tuple[HetComponent, ...], gpus_by_partition: Mapping[str, int]) -> None:
    """UsageError when a component asks more GPUs per node than any node of its partition has."""
    for component in components:
        have = gpus_by_partition.get(component.partition, 0)
        if component.gpus_per_node > have:
            where = repr(component.partition) if component.partition else "(default)"
            raise UsageError(
                f"roles {', '.join(component.roles)} ask {component.gpus_per_node} GPUs per node on partition "
                f"{where}, whose nodes have at most {have}; lower roles.<role>.gpus_per_rank or ranks_per_node"
            )


def plan_line(components: tuple[HetComponent, ...]) -> str:
    world = sum(c.num_ranks for c in components)
    parts = "; ".join(f"[{i}] {c.describe()}" for i, c in enumerate(components))
    return f"[slurm] world of {world} ranks in {len(components)} components: {parts}"


def render_hetjob(
    spec: JobSpec, components: tuple[HetComponent, ...], template_dir: Path = TEMPLATE_DIR
) -> str:
    """The sbatch script of a heterogeneous job running `rollart_hpc.entry.worker` on every rank."""
    if len(components) < 2:
        raise ValueError(f"a heterogeneous job needs at least 2 components, got {len(components)}")
    return render_job(spec, components, template_dir)


def render_job(spec: JobSpec, components: tuple[HetComponent, ...], template_dir: Path = TEMPLATE_DIR) -> str:
    """The sbatch script of a job of one or more components (one srun step over all of them)."""
    groups = ",".join(str(i) for i in range(len(components)))
    values = {
        "JOB_NAME": shlex.quote(spec.name),
        "OUTPUT": shlex.quote(str(spec.hetjob_output)),
        "SIGNAL_DELAY_S": str(spec.signal_delay_s),
        "TIME_MIN": str(spec.time_min),
        "MAX_REQUEUES": str(spec.max_requeues),
        "MAX_RESTARTS": str(spec.max_restarts),
        "EXPORTS": "\n".join(export_lines(spec)),
        "FINISH_MARKER": shlex.quote(spec.finish_marker or ""),
        "COMPONENTS": "\n".join(component_lines(components)),
        "RUN_DIR": shlex.quote(str(spec.run_dir)),
        "MPI_ENV": shlex.quote(str(spec.mpi_env)),
        "PLAN": shlex.quote(plan_line(components)),
        "WORLD_SIZE": str(sum(c.num_ranks for c in components)),
        "HET_GROUP_ARG": f"--het-group={groups} " if len(components) > 1 else "",
        "PYTHON": shlex.quote(spec.python),
    }
    return fill_template((template_dir / HETJOB_TEMPLATE).read_text(), values)


def submitit_parameters(spec: JobSpec, plan: RunPlan, nodes: int) -> dict[str, Any]:
    """`SlurmExecutor.update_parameters` keywords for a world on one partition, `nodes` nodes."""
    world = plan.world_size
    component = single_component(plan, nodes)
    params: dict[str, Any] = {
        "job_name": spec.name,
        "nodes": nodes,
        "ntasks_per_node": world // nodes,
        "time": spec.time_min,
        "signal_delay_s": spec.signal_delay_s,
        "setup": [
            *export_lines(spec),
            f"source {shlex.quote(str(spec.mpi_env))} || exit 1",
            *restart_trap(spec),
        ],
        "srun_args": ["--mpi=pmix", "--kill-on-bad-exit=1"],
        "additional_parameters": {"requeue": True},
    }
    if component.partition:
        params["partition"] = component.partition
    params.update(submitit_resources(component))
    return params


def export_lines(spec: JobSpec) -> list[str]:
    """The job's `export` lines: unbuffered Python output, then the run's network settings (quoted)."""
    return ["export PYTHONUNBUFFERED=1", *(f"export {name}={shlex.quote(value)}" for name, value in spec.env)]


def restart_trap(spec: JobSpec) -> list[str]:
    """Setup line of a submitit job with `max_restarts`: once the srun step failed, the batch shell's EXIT
    trap asks `rollart_hpc.entry.restarts` whether to restart and, if so, requeues the job (exit 0)."""
    if spec.max_restarts == 0 or spec.finish_marker is None:
        return []
    command = (
        f"{shlex.quote(spec.python)} -m rollart_hpc.entry.restarts {shlex.quote(str(spec.run_dir))} "
        f'"$status" {spec.max_restarts} --requeue && exit 0'
    )
    return [f"trap {shlex.quote(f'status=$?; [ $status -ne 0 ] && {command}')} EXIT"]


def submitit_resources(component: HetComponent) -> dict[str, Any]:
    """The component's requests as submitit keywords (extra sbatch lines go to additional_parameters)."""
    params: dict[str, Any] = {}
    if component.gpus_per_node:
        params["gres"] = gres(component)
    if component.cpus_per_task:
        params["cpus_per_task"] = component.cpus_per_task
    if component.mem_gb_per_node:
        params["mem"] = f"{component.mem_gb_per_node}G"
    if component.constraint:
        params["constraint"] = component.constraint
    for line in component.extra:
        key, sep, value = line[2:].partition("=")
        params.setdefault("additional_parameters", {"requeue": True})[key.replace("-", "_")] = (
            value if sep else True
        )
    return params


ARRAY_TEMPLATE = "array.sbatch.in"
ARRAY_OUTPUT = "slurm-array-%A_%a.out"


def render_array_job(
    name: str,
    sweep_dir: Path,
    run_dirs: Sequence[Path],
    component: HetComponent,
    time_min: int,
    signal_delay_s: int = 60,
    template_dir: Path = TEMPLATE_DIR,
) -> str:
    """The sbatch script of a job array (`launch.py sweep --slurm`): element i execs the job script of
    `run_dirs[i]` (`RUN_DIR/job.sbatch`, from `render_job` with this one component), which keeps its
    traps, restarts and requeue (of that element only: each element has its own SLURM_JOB_ID)."""
    if not run_dirs:
        raise ValueError("a job array needs at least one run dir")
    for path in (sweep_dir, *run_dirs):
        check_run_dir(path)
    values = {
        "JOB_NAME": shlex.quote(name),
        "OUTPUT": shlex.quote(str(sweep_dir / ARRAY_OUTPUT)),
        "SIGNAL_DELAY_S": str(signal_delay_s),
        "TIME_MIN": str(time_min),
        "LAST_INDEX": str(len(run_dirs) - 1),
        "COMPONENTS": "\n".join(component_lines((component,))),
        "RUN_DIRS": "\n".join(f"  {shlex.quote(str(path))}" for path in run_dirs),
    }
    return fill_template((template_dir / ARRAY_TEMPLATE).read_text(), values)


SERVICE_TEMPLATE = "reward_service.sbatch.in"
SERVICE_SCRIPT = "reward_service.sbatch"
SERVICE_OUTPUT = "slurm-%j.out"


@dataclass(frozen=True)
class ServiceJob:
    """The reward service's own job (`launch.py reward-service --slurm`): one task on `partition` ('' =
    the default) that runs the service for `config` + `overrides` in `service_dir` (absolute) until it
    has been idle `idle_exit_s` (0: until stopped) or the time limit."""

    config: Path
    overrides: tuple[str, ...]
    service_dir: Path
    time_min: int
    idle_exit_s: float
    partition: str = ""
    name: str = "reward-service"
    python: str = field(default_factory=lambda: sys.executable)
    launch: Path = REPO_ROOT / "launch.py"


def render_service_job(job: ServiceJob, template_dir: Path = TEMPLATE_DIR) -> str:
    """The sbatch script of the reward service's job; every user value is shell-quoted."""
    check_run_dir(job.service_dir)
    resources = (
        f"#SBATCH --partition={shlex.quote(job.partition)}" if job.partition else "# default partition"
    )
    values = {
        "JOB_NAME": shlex.quote(job.name),
        "OUTPUT": shlex.quote(str(job.service_dir / SERVICE_OUTPUT)),
        "TIME_MIN": str(job.time_min),
        "RESOURCES": resources,
        "PYTHON": shlex.quote(job.python),
        "LAUNCH": shlex.quote(str(job.launch)),
        "CONFIG": shlex.quote(str(job.config)),
        "OVERRIDES": "".join(f"{shlex.quote(o)} " for o in job.overrides),
        "SERVICE_DIR": shlex.quote(str(job.service_dir)),
        "IDLE_EXIT_S": f"{job.idle_exit_s:g}",
    }
    return fill_template((template_dir / SERVICE_TEMPLATE).read_text(), values)
