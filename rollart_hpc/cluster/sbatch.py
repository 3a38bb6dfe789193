"""What `launch.py submit` hands to SLURM for a run plan: hetjob sbatch scripts and submitit parameters.

Pure rendering: no subprocess, no SLURM client, no submitit import, so every output is pinned by golden
files. Invariants of a rendered job:
- The hetjob components cover the plan's ranks in plan order with no gap: component i holds world
  ranks [start_i, start_i + num_ranks_i) and start_{i+1} = start_i + num_ranks_i. `srun --het-group=0,...,k`
  numbers the tasks of component 0 first, then component 1, ..., so MPI world rank == plan rank.
- Adjacent roles on the same partition share one component; roles with no ranks get none.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart_hpc.cluster.plan import RunPlan
from rollart_hpc.contracts.errors import UsageError

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
FINISH_MARKERS: dict[str, str | None] = {"rl": "summary.json", "smoke": None}


@dataclass(frozen=True)
class HetComponent:
    """One `#SBATCH hetjob` component: a contiguous block of world ranks on one partition."""

    partition: str
    start: int
    num_ranks: int
    roles: tuple[str, ...]

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.num_ranks)

    def describe(self) -> str:
        last = self.start + self.num_ranks - 1
        span = f"rank {self.start}" if last == self.start else f"ranks {self.start}-{last}"
        return f"{span} on {self.partition or '(default partition)'}: {', '.join(self.roles)}"


@dataclass(frozen=True)
class JobSpec:
    """What every submission of a run shares. `run_dir`, `python` and `mpi_env` are absolute paths;
    `job` is the run's `run.job` (a key of FINISH_MARKERS)."""

    name: str
    run_dir: Path
    time_min: int
    max_requeues: int
    signal_delay_s: int = 60
    python: str = field(default_factory=lambda: sys.executable)
    mpi_env: Path = MPI_ENV
    job: str = field(kw_only=True)

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
    components: list[HetComponent] = []
    for role in plan.roles:
        if role.num_ranks == 0:
            continue
        last = components[-1] if components else None
        if last is not None and last.partition == role.partition:
            merged = HetComponent(
                last.partition, last.start, last.num_ranks + role.num_ranks, (*last.roles, role.role)
            )
            components[-1] = merged
        else:
            components.append(HetComponent(role.partition, role.start, role.num_ranks, (role.role,)))
    return tuple(components)


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
    return lines


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
    values = {
        "JOB_NAME": shlex.quote(spec.name),
        "OUTPUT": shlex.quote(str(spec.hetjob_output)),
        "SIGNAL_DELAY_S": str(spec.signal_delay_s),
        "TIME_MIN": str(spec.time_min),
        "MAX_REQUEUES": str(spec.max_requeues),
        "FINISH_MARKER": shlex.quote(spec.finish_marker or ""),
        "COMPONENTS": "\n".join(component_lines(components)),
        "RUN_DIR": shlex.quote(str(spec.run_dir)),
        "MPI_ENV": shlex.quote(str(spec.mpi_env)),
        "PLAN": shlex.quote(plan_line(components)),
        "HET_GROUPS": ",".join(str(i) for i in range(len(components))),
        "PYTHON": shlex.quote(spec.python),
    }
    return fill_template((template_dir / HETJOB_TEMPLATE).read_text(), values)


def submitit_parameters(spec: JobSpec, plan: RunPlan, nodes: int) -> dict[str, Any]:
    """`SlurmExecutor.update_parameters` keywords for a world on one partition, `nodes` nodes."""
    world = plan.world_size
    if nodes < 1 or world % nodes:
        raise UsageError(f"--nodes {nodes}: the world of {world} ranks must split evenly over the nodes")
    partitions = plan_partitions(plan)
    if len(partitions) > 1:
        raise ValueError(f"submitit runs one partition; the plan has {', '.join(partitions)}")
    params: dict[str, Any] = {
        "job_name": spec.name,
        "nodes": nodes,
        "ntasks_per_node": world // nodes,
        "time": spec.time_min,
        "signal_delay_s": spec.signal_delay_s,
        "setup": ["export PYTHONUNBUFFERED=1", f"source {shlex.quote(str(spec.mpi_env))} || exit 1"],
        "srun_args": ["--mpi=pmix", "--kill-on-bad-exit=1"],
        "additional_parameters": {"requeue": True},
    }
    if partitions and partitions[0]:
        params["partition"] = partitions[0]
    return params
