"""`launch.py sweep CONFIG --grid key=v1,v2 ... --seeds 0,1,2 --out DIR`: a grid of runs over seeds.

Every combination of the grid's values (the product over `--grid` keys, in the order given) is an *arm*;
every arm runs once per seed (`run.seed`). Each run is an ordinary run directory
`DIR/<arm>/seed=<s>` (arm = `key=value` pairs joined by `__`, `base` without a grid; characters other
than letters, digits and `._=+-` become `_`), made and launched exactly as `launch.py run` does (a
subprocess `run CONFIG --set... grid... run.seed=S --run-dir RUN_DIR`). `DIR/sweep.json` lists every run
with its arm, seed and overrides (`launch.py compare DIR` reads it).

Resumable: on a rerun with the same DIR, a finished run (its finish marker, `summary.json`, exists) is
skipped; a started one (resolved config plus outputs or a checkpoint) continues from its last complete
checkpoint through `launch.py resume RUN_DIR` (the same path as by hand); any other run starts fresh. A
run dir whose resolved config differs from the one the sweep resolves now is refused (one line).

Locally `--parallel N` runs at a time (subprocesses, default 1); each run's console output is in
`RUN_DIR/sweep.log`. A failing run is reported with its log and the others go on; the exit code is 1
if any run failed. Ctrl-C or SIGTERM stop every started run (SIGTERM, by pid: each launcher then ends
its world) before the sweep exits.

With `--slurm` the runs still to do are ONE job array (`#SBATCH --array=0-K`,
`slurm/templates/array.sbatch.in`): element i execs `RUN_DIR/job.sbatch`, the single-component script
`launch.py submit --dry-run --out` writes for that run (`rollart_hpc.cluster.sbatch.render_job`: stop
signal traps, the srun step with srun_watch, restarts after a failed step, requeue of that element on
preemption), with its output in `RUN_DIR/slurm-<element job id>.out`. SLURM has no arrays of
heterogeneous jobs, so every role must sit on one partition (the error says so otherwise).

`--shared-warm-start` (local sweeps): the arms of one seed start from one warm start instead of one each.
Per seed, a warm-start run `DIR/warm/seed=<s>` (the config with `controller.num_steps=1` and no evaluation)
is run first (or reused once finished); every arm's run of that seed then starts from its warm model
(`model.source="path"`, `model.path=DIR/warm/seed=<s>/model/warm`, `trainer.sft_steps=0`). So the arms are
compared from the same initial policy, and the sweep spends one warm start per seed. A grid key that changes
the warm start (under `model.`, `envs.`, `roles.`, `run.`, or `trainer.sft_`) is refused.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_hpc.cluster import slurm
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.entry import restarts

if TYPE_CHECKING:
    from rollart_hpc.cluster.sbatch import HetComponent
    from rollart_hpc.config.schema import Config

SWEEP_JSON = "sweep.json"
SWEEP_LOG = "sweep.log"
ARRAY_SCRIPT = "array.sbatch"
SEED_KEY = "run.seed"
WARM_ARM = "warm"
WARM_START_KEYS = ("model.", "envs.", "roles.", "run.", "trainer.sft_")  # grid keys a warm start depends on
FINISHED, RESUME, FRESH = "finished", "resume", "fresh"
POLL_S = 0.5


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: its arm (grid combination), seed and the overrides that make it."""

    arm: str
    seed: int
    grid: tuple[tuple[str, str], ...]  # (key, value) of every grid key, in grid order
    extra: tuple[str, ...] = ()  # overrides of the sweep's own making (the shared warm start)

    @property
    def name(self) -> str:
        return f"{self.arm}/seed={self.seed}"

    @property
    def overrides(self) -> tuple[str, ...]:
        return (*(f"{key}={value}" for key, value in self.grid), f"{SEED_KEY}={self.seed}", *self.extra)


def warm_start_run(seed: int) -> SweepRun:
    """The run whose warm model the arms of `seed` share: the config, one RL step, no evaluation."""
    return SweepRun(WARM_ARM, seed, (), ("controller.num_steps=1", "controller.eval_every_steps=0"))


def warm_model_overrides(warm_run_dir: Path) -> tuple[str, ...]:
    """Overrides that start a run from the warm model of a finished warm-start run (no supervised steps)."""
    warm = RunLayout(warm_run_dir).model / "warm"
    return ('model.source="path"', f"model.path={json.dumps(str(warm))}", "trainer.sft_steps=0")


def from_warm_start(run: SweepRun, out: Path) -> SweepRun:
    """`run`, started from the shared warm model of its seed (no supervised steps of its own)."""
    return replace(run, extra=warm_model_overrides(out / warm_start_run(run.seed).name))


def check_shared_warm_start(grid: Sequence[tuple[str, Sequence[str]]]) -> None:
    for key, _ in grid:
        if key.startswith(WARM_START_KEYS):
            raise UsageError(
                f"--shared-warm-start: --grid {key} changes the warm start; sweep it without sharing"
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML run config (see configs/)")
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a dotted config key and its values (repeat for a product grid)",
    )
    parser.add_argument("--seeds", default="0", help="comma-separated run.seed values (default 0)")
    parser.add_argument("--out", required=True, help="sweep directory (one run dir per arm and seed)")
    parser.add_argument("--parallel", type=int, default=1, help="local runs at a time (default 1)")
    parser.add_argument("--slurm", action="store_true", help="submit the runs as one SLURM job array")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every run"
    )
    parser.add_argument("--time-min", type=int, default=60, help="--slurm: minutes per element (default 60)")
    parser.add_argument(
        "--max-requeues", type=int, default=3, help="--slurm: requeues per element after a stop (default 3)"
    )
    parser.add_argument("--nodes", type=int, default=1, help="--slurm: nodes per element (default 1)")
    parser.add_argument(
        "--shared-warm-start",
        action="store_true",
        help="the arms of a seed start from one warm start, run first (local sweeps)",
    )
    restarts.add_argument(parser)


# --- planning ---------------------------------------------------------------------------------------


def split_values(raw: str) -> list[str]:
    """`0.8,0.9` -> ['0.8', '0.9']; commas inside brackets or quotes do not split (`['a','b'],['c']`)."""
    values, depth, quote, current = [], 0, "", ""
    for char in raw:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(current.strip())
            current = ""
            continue
        current += char
    return [*values, current.strip()]


def parse_grid(texts: Sequence[str]) -> list[tuple[str, list[str]]]:
    """`--grid` options -> [(key, values)]; UsageError for a missing `=`, an empty value or a repeated key."""
    grid: list[tuple[str, list[str]]] = []
    for text in texts:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--grid {text!r}: expected KEY=V1,V2,...")
        values = split_values(raw)
        if not all(values):
            raise UsageError(f"--grid {text!r}: empty value in the list {raw!r}")
        if key == SEED_KEY:
            raise UsageError(f"--grid {key}: give seeds with --seeds")
        if key in {k for k, _ in grid}:
            raise UsageError(f"--grid {key} given twice")
        if len(set(values)) != len(values):
            raise UsageError(f"--grid {text!r}: a value is repeated")
        grid.append((key, values))
    return grid


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise UsageError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds {text!r}: a seed is repeated")
    return seeds


def slug(text: str) -> str:
    """A path component: letters, digits and `._=+-` kept, anything else `_`."""
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text)


def expand(grid: Sequence[tuple[str, Sequence[str]]], seeds: Sequence[int]) -> list[SweepRun]:
    """Every grid combination (the first key varies slowest) times every seed."""
    keys = [key for key, _ in grid]
    runs = []
    for values in itertools.product(*(vals for _, vals in grid)):
        pairs = tuple(zip(keys, values, strict=True))
        arm = "__".join(slug(f"{k}={v}") for k, v in pairs) or "base"
        runs += [SweepRun(arm, seed, pairs) for seed in seeds]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise UsageError(
            "two grid values give the same run directory name; make them differ in [A-Za-z0-9._=+-]"
        )
    return runs


def run_state(run_dir: Path, finish_marker: str) -> str:
    """FINISHED (finish marker), RESUME (a resolved config and outputs or a checkpoint), else FRESH."""
    from rollart_hpc.config.resolve import RESOLVED_NAME
    from rollart_hpc.entry.launcher import RUN_OUTPUTS

    if (run_dir / finish_marker).exists():
        return FINISHED
    started = any((run_dir / name).exists() for name in RUN_OUTPUTS) or any(
        RunLayout(run_dir).checkpoints.glob("step-*")
    )
    return RESUME if (run_dir / RESOLVED_NAME).exists() and started else FRESH


def resolve_runs(
    config_path: str, sets: Sequence[str], runs: Sequence[SweepRun], out: Path
) -> dict[str, Config]:
    """Load every run's config (a bad key or value is a UsageError naming it, before anything starts) and
    check that a run dir made earlier was made with the same config."""
    from rollart_hpc.config import load_config, read_resolved
    from rollart_hpc.config.loader import to_dict
    from rollart_hpc.config.resolve import RESOLVED_NAME

    configs = {}
    for run in runs:
        config = load_config(config_path, [*sets, *run.overrides])
        if config.run.job != "rl":
            raise UsageError(f"sweeps run RL configs; {config_path} has run.job = {config.run.job!r}")
        run_dir = out / run.name
        if (run_dir / RESOLVED_NAME).exists() and to_dict(read_resolved(run_dir)) != to_dict(config):
            raise UsageError(
                f"{run_dir} was made with another config than this sweep's; use a new --out or remove it"
            )
        configs[run.name] = config
    return configs


def write_sweep_json(out: Path, config_path: str, sets: Sequence[str], runs: Sequence[SweepRun]) -> None:
    """DIR/sweep.json: the sweep's config, --set overrides and every run (runs of an earlier invocation
    with other grid values or seeds are kept). Another config or --set in the same DIR is refused."""
    from rollart_hpc.contracts.atomic import atomic_write_json

    path = out / SWEEP_JSON
    old = json.loads(path.read_text()) if path.exists() else {}
    head = {"config": str(Path(config_path).resolve()), "set": list(sets)}
    if old and {k: old.get(k) for k in head} != head:
        raise UsageError(f"{path} is a sweep of another config or --set; use a new --out")
    rows = {row["name"]: row for row in old.get("runs", [])}
    for run in runs:
        rows[run.name] = {
            "name": run.name,
            "arm": run.arm,
            "seed": run.seed,
            "grid": dict(run.grid),
            "overrides": list(run.overrides),
            "run_dir": run.name,
        }
    atomic_write_json(path, {**old, **head, "runs": list(rows.values())})


def read_sweep_runs(out: Path) -> list[dict[str, Any]]:
    """The runs listed in DIR/sweep.json (`name`, `arm`, `seed`, `grid`, `overrides`, `run_dir`)."""
    return list(json.loads((out / SWEEP_JSON).read_text())["runs"])


# --- entry --------------------------------------------------------------------------------------------


def check_options(args: argparse.Namespace) -> None:
    restarts.checked_count(args.max_restarts)
    if args.parallel < 1:
        raise UsageError(f"--parallel must be >= 1, got {args.parallel}")
    if args.time_min < 1 or args.max_requeues < 0 or args.nodes < 1:
        raise UsageError("--time-min and --nodes must be >= 1, --max-requeues >= 0")
    for text in args.set:
        if "=" not in text:
            raise UsageError(f"--set {text!r}: expected KEY=VALUE")
    if args.shared_warm_start:
        if args.slurm:
            raise UsageError("--shared-warm-start runs the warm starts locally first; not with --slurm")
        check_shared_warm_start(parse_grid(args.grid))
    grid_keys = {key for key, _ in parse_grid(args.grid)}
    clash = sorted(grid_keys & {t.partition("=")[0].strip() for t in args.set})
    if clash or SEED_KEY in {t.partition("=")[0].strip() for t in args.set}:
        raise UsageError(f"--set {(clash or [SEED_KEY])[0]}: this key is swept (--grid / --seeds)")


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.sbatch import FINISH_MARKERS, check_run_dir

    check_options(args)
    runs = expand(parse_grid(args.grid), parse_seeds(args.seeds))
    out = Path(args.out).resolve()
    if args.slurm:
        check_run_dir(out)
    warm = [warm_start_run(seed) for seed in parse_seeds(args.seeds)] if args.shared_warm_start else []
    runs = [from_warm_start(r, out) for r in runs] if warm else runs
    configs = resolve_runs(args.config, args.set, [*warm, *runs], out)
    out.mkdir(parents=True, exist_ok=True)
    write_sweep_json(out, args.config, args.set, runs)
    if warm and run_warm_starts(out, warm, args) != 0:
        print("a warm start failed: no arm was started", flush=True)
        return 1
    states = {r.name: run_state(out / r.name, str(FINISH_MARKERS["rl"])) for r in runs}
    print(f"sweep {out}: {len(runs)} runs", flush=True)
    for run in runs:
        print(f"  {run.name:<40} {states[run.name]}", flush=True)
    todo = [r for r in runs if states[r.name] != FINISHED]
    if not todo:
        print("every run has finished", flush=True)
        return 0
    if args.slurm:
        return submit_array(out, todo, configs, states, args)
    commands = {
        r.name: run_command(args.config, args.set, r, out, states[r.name], args.max_restarts) for r in todo
    }
    return run_local(out, [r.name for r in todo], commands, args.parallel)


def run_warm_starts(out: Path, warm: Sequence[SweepRun], args: argparse.Namespace) -> int:
    """Run (or resume) the warm-start run of every seed that has not finished; 0 when all have."""
    from rollart_hpc.cluster.sbatch import FINISH_MARKERS

    states = {r.name: run_state(out / r.name, str(FINISH_MARKERS["rl"])) for r in warm}
    todo = [r for r in warm if states[r.name] != FINISHED]
    for run in warm:
        print(f"  {run.name:<40} {states[run.name]} (shared warm start)", flush=True)
    if not todo:
        return 0
    commands = {
        r.name: run_command(args.config, args.set, r, out, states[r.name], args.max_restarts) for r in todo
    }
    return run_local(out, [r.name for r in todo], commands, args.parallel)


def run_command(
    config_path: str, sets: Sequence[str], run: SweepRun, out: Path, state: str, max_restarts: int
) -> list[str]:
    """The `launch.py run` (fresh) or `launch.py resume` command of a run."""
    cli = [sys.executable, "-m", "rollart_hpc.entry.cli"]
    restart = ["--max-restarts", str(max_restarts)]
    if state == RESUME:
        return [*cli, "resume", str(out / run.name), *restart]
    return [*cli, "run", config_path, *sets, *run.overrides, "--run-dir", str(out / run.name), *restart]


# --- local --------------------------------------------------------------------------------------------


def run_local(out: Path, names: Sequence[str], commands: dict[str, list[str]], parallel: int) -> int:
    """Run the commands, `parallel` at a time; report each end; 1 if any run failed."""
    pending, failed = list(names), []
    running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    done = 0
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while pending or running:
            while pending and len(running) < parallel:
                name = pending.pop(0)
                print(f"[sweep] start {name} (log {out / name / SWEEP_LOG})", flush=True)
                running[name] = (start_run(out / name, commands[name]), time.monotonic())
            for name, (proc, started) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                took = time.monotonic() - started
                if proc.returncode == 0:
                    done += 1
                    print(f"[sweep] {name} finished in {took:.0f}s", flush=True)
                else:
                    failed.append(name)
                    log = out / name / SWEEP_LOG
                    print(
                        f"[sweep] {name} FAILED (exit {proc.returncode}) after {took:.0f}s; log {log}",
                        flush=True,
                    )
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        stop_runs([proc for proc, _ in running.values()])
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"[sweep] {done} finished, {len(failed)} failed: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def start_run(run_dir: Path, command: list[str]) -> subprocess.Popen[bytes]:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / SWEEP_LOG).open("ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_runs(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """SIGTERM each launcher by pid (it stops its world in order), SIGKILL any left after the grace."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- SLURM --------------------------------------------------------------------------------------------


def submit_array(
    out: Path,
    todo: Sequence[SweepRun],
    configs: dict[str, Config],
    states: dict[str, str],
    args: argparse.Namespace,
) -> int:
    """Prepare every run dir with its single-component job script, then sbatch one array over them."""
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.cluster.sbatch import (
        check_gpus_fit,
        check_single_fit,
        render_array_job,
        render_job,
    )
    from rollart_hpc.contracts.atomic import atomic_write_bytes, atomic_write_json
    from rollart_hpc.entry import submit

    components = {r.name: array_component(configs[r.name], args.nodes) for r in todo}
    first = components[todo[0].name]
    for run in todo:
        if components[run.name] != first:
            raise UsageError(
                f"runs of one job array ask the same resources; {run.name} asks "
                f"{components[run.name].describe()}, {todo[0].name} {first.describe()}"
            )
    submit.require_slurm()
    nodes_by_partition = slurm.partition_nodes()
    check_single_fit(first.partition, args.nodes, nodes_by_partition)
    check_cpus_fit(first, nodes_by_partition[first.partition])
    check_gpus_fit((first,), slurm.partition_gpus())
    specs = {}
    for run in todo:
        config, run_dir = configs[run.name], out / run.name
        spec = submit.job_spec(config, run_dir, args.time_min, args.max_requeues)
        if states[run.name] == RESUME:
            restarts.check_resumable_run(run_dir, config)
        submit.prepare_run_dir(config, run_dir)  # the same config (resolve_runs checked it); drops failures/
        atomic_write_bytes(RunLayout(run_dir).job_script, render_job(spec, (first,)).encode())
        specs[run.name] = spec
    name = f"{configs[todo[0].name].run.name}-sweep"
    script = render_array_job(
        name, out, [out / r.name for r in todo], first, args.time_min, specs[todo[0].name].signal_delay_s
    )
    atomic_write_bytes(out / ARRAY_SCRIPT, script.encode())
    job_id = submit.sbatch(out / ARRAY_SCRIPT)
    record_array(out, job_id, todo)
    for index, run in enumerate(todo):
        plan = make_plan(configs[run.name].roles)
        record = submit.job_record(specs[run.name], plan, "array", f"{job_id}_{index}", [])
        atomic_write_json(out / run.name / submit.JOB_RECORD, record)
    print(f"submitted job array {job_id} ({len(todo)} elements, script {out / ARRAY_SCRIPT})", flush=True)
    for index, run in enumerate(todo):
        print(f"  {job_id}_{index}: {run.name} (log {out / run.name}/slurm-<element job id>.out)", flush=True)
    return 0


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
