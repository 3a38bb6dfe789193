"""`launch.py submit` without a cluster: component grouping, golden files of rendered jobs, hostile paths.

Golden files live in tests/golden/; regenerate them with `UPDATE_GOLDEN=1 pytest tests/test_submit.py`.
The rendered hetjob script is also executed by bash with stub `srun`/`scontrol` on PATH, so the quoting
of run dirs with spaces and quotes is checked by a real shell, not only by eye.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollart_hpc.cluster.plan import RoleRange, RunPlan, make_plan
from rollart_hpc.cluster.sbatch import (
    HetComponent,
    JobSpec,
    check_components_fit,
    check_run_dir,
    check_single_fit,
    fill_template,
    het_components,
    plan_partitions,
    render_hetjob,
    submitit_parameters,
    unplaceable_components,
)
from rollart_hpc.config import load_config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry import submit

GOLDEN = Path(__file__).resolve().parent / "golden"
ROOT = Path(__file__).resolve().parents[1]
HOSTILE_RUN_DIR = Path('/tmp/a b/it\'s "x"')
FIXED_PYTHON = "/opt/rollart/.venv/bin/python"
FIXED_MPI_ENV = Path("/opt/rollart/slurm/mpi_env.sh")

TWO_PARTITIONS = """\
[run]
name = "it's \\"smoke\\""
job = "smoke"
[roles.controller]
partition = "rollout"
[roles.rollout]
num_ranks = 2
partition = "rollout"
[roles.env]
num_ranks = 2
partition = "rollout"
[roles.reward]
partition = "rollout"
[roles.trainer]
num_ranks = 2
partition = "train"
"""

THREE_PARTITIONS = """\
[run]
name = "three parts"
job = "rl"
[roles.controller]
partition = "cpu"
[roles.rollout]
num_ranks = 3
partition = "infer"
[roles.env]
num_ranks = 4
partition = "cpu"
[roles.reward]
num_ranks = 2
partition = "cpu"
[roles.trainer]
num_ranks = 2
partition = "train gpu"
"""

ONE_PARTITION = """\
[run]
name = "single"
job = "smoke"
[roles.controller]
partition = "all"
[roles.rollout]
partition = "all"
[roles.env]
num_ranks = 3
partition = "all"
[roles.reward]
partition = "all"
[roles.trainer]
partition = "all"
"""


def _plan(*roles: tuple[str, int, str]) -> RunPlan:
    ranges, start = [], 0
    for name, num, partition in roles:
        ranges.append(RoleRange(name, start, num, partition))
        start += num
    return RunPlan(tuple(ranges))


def _config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def _spec(name: str, run_dir: Path = HOSTILE_RUN_DIR, job: str = "rl") -> JobSpec:
    return JobSpec(name, run_dir, 30, 2, python=FIXED_PYTHON, mpi_env=FIXED_MPI_ENV, max_restarts=2, job=job)


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing; run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{name} differs from its golden file; UPDATE_GOLDEN=1 regenerates it"


# --- component grouping -------------------------------------------------------------------------------


def test_adjacent_roles_on_one_partition_share_a_component() -> None:
    plan = _plan(("controller", 1, "cpu"), ("rollout", 2, "cpu"), ("env", 3, "gpu"), ("reward", 1, "gpu"))
    assert het_components(plan) == (
        HetComponent("cpu", 0, 3, ("controller", "rollout")),
        HetComponent("gpu", 3, 4, ("env", "reward")),
    )


def test_non_adjacent_roles_on_one_partition_stay_apart_in_rank_order() -> None:
    plan = _plan(("controller", 1, "a"), ("rollout", 2, "b"), ("env", 1, "a"), ("trainer", 2, "c"))
    components = het_components(plan)
    assert [c.partition for c in components] == ["a", "b", "a", "c"]
    assert [list(c.ranks) for c in components] == [[0], [1, 2], [3], [4, 5]]


def test_roles_without_ranks_get_no_component_and_do_not_split_a_block() -> None:
    plan = _plan(
        ("controller", 1, "a"), ("rollout", 1, "a"), ("env", 1, "a"), ("reward", 0, "b"), ("trainer", 1, "a")
    )
    assert het_components(plan) == (HetComponent("a", 0, 4, ("controller", "rollout", "env", "trainer")),)
    assert plan_partitions(plan) == ("a",)


def test_components_tile_the_world_in_plan_order(repo_root: Path) -> None:
    config = load_config(
        repo_root / "configs" / "smoke.toml", ["roles.env.partition=x", "roles.env.num_ranks=3"]
    )
    plan = make_plan(config.roles)
    components = het_components(plan)
    flat = [rank for c in components for rank in c.ranks]
    assert flat == list(range(plan.world_size))
    for component in components:
        assert {plan.role_of(r).partition for r in component.ranks} == {component.partition}


def test_empty_partition_is_its_own_group() -> None:
    plan = _plan(("controller", 1, ""), ("rollout", 1, "gpu"), ("env", 1, ""))
    assert plan_partitions(plan) == ("", "gpu")
    assert [c.partition for c in het_components(plan)] == ["", "gpu", ""]


# --- fitting components to nodes ------------------------------------------------------------------------


def test_components_need_a_node_each() -> None:
    two_nodes = {"rollout": ["r1"], "train": ["t1"], "all": ["r1", "t1"], "": ["r1"]}
    fits = (HetComponent("all", 0, 1, ("a",)), HetComponent("rollout", 1, 1, ("b",)))
    assert unplaceable_components(fits, two_nodes) == []  # needs the augmenting path: all -> t1
    check_components_fit(fits, two_nodes)
    too_many = (*fits, HetComponent("train", 2, 1, ("c",)))
    assert len(unplaceable_components(too_many, two_nodes)) == 1
    with pytest.raises(UsageError, match="nodes of its own"):
        check_components_fit(too_many, two_nodes)
    with pytest.raises(UsageError, match="'gpu' of c not found"):
        check_components_fit((HetComponent("gpu", 0, 1, ("c",)),), two_nodes)


def test_single_partition_fit() -> None:
    nodes = {"all": ["r1", "t1"], "": ["r1"]}
    check_single_fit("all", 2, nodes)
    check_single_fit("", 1, nodes)
    with pytest.raises(UsageError, match="has 1 nodes"):
        check_single_fit("", 2, nodes)
    with pytest.raises(UsageError, match="not found"):
        check_single_fit("gpu", 1, nodes)


# --- templates and hostile input ------------------------------------------------------------------------


def test_fill_template_is_one_pass_and_checks_names() -> None:
    assert fill_template("a=@A@ b=@B@", {"A": "@B@", "B": "x"}) == "a=@B@ b=x"
    with pytest.raises(ValueError, match="missing"):
        fill_template("@A@ @B@", {"A": "1"})
    with pytest.raises(ValueError, match="unused"):
        fill_template("@A@", {"A": "1", "C": "2"})


@pytest.mark.parametrize("bad", ["/tmp/100%/run", "/tmp/a\\b", "/tmp/a\nb"])
def test_run_dirs_that_slurm_rewrites_are_refused(bad: str) -> None:
    with pytest.raises(UsageError, match="SLURM rewrites"):
        check_run_dir(Path(bad))
    check_run_dir(HOSTILE_RUN_DIR)


def test_hetjob_needs_two_components() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        render_hetjob(_spec("x"), (HetComponent("a", 0, 1, ("controller",)),))


# --- golden files -------------------------------------------------------------------------------------


def _render(tmp_path: Path, text: str) -> str:
    config = load_config(_config_file(tmp_path, text))
    plan = make_plan(config.roles)
    return render_hetjob(_spec(config.run.name, job=config.run.job), het_components(plan))


def test_golden_hetjob_two_partitions(tmp_path: Path) -> None:
    script = _render(tmp_path, TWO_PARTITIONS)
    _check_golden("hetjob_2_partitions.sbatch", script)
    assert "--het-group=0,1 " in script and script.count("#SBATCH hetjob") == 1
    assert "\nFINISH_MARKER=''\n" in script  # the smoke job has no checkpoints: its exit 0 is the end


def test_golden_hetjob_three_partitions(tmp_path: Path) -> None:
    script = _render(tmp_path, THREE_PARTITIONS)
    _check_golden("hetjob_3_partitions.sbatch", script)
    assert "--het-group=0,1,2,3 " in script and script.count("#SBATCH hetjob") == 3
    assert "#SBATCH --partition='train gpu'" in script
    assert "\nFINISH_MARKER=summary.json\n" in script


def test_golden_submitit_parameters_and_script(tmp_path: Path) -> None:
    from submitit.slurm.slurm import _make_sbatch_string

    config = load_config(_config_file(tmp_path, ONE_PARTITION))
    spec = _spec(config.run.name)
    params = submitit_parameters(spec, make_plan(config.roles), nodes=1)
    _check_golden("submitit_parameters.json", json.dumps(params, indent=1, sort_keys=True) + "\n")
    command = f"{FIXED_PYTHON} -u -m submitit.core._submit {shlex.quote(str(spec.submitit_folder))}"
    script = _make_sbatch_string(command=command, folder=spec.submitit_folder, **params)
    _check_golden("submitit.sbatch", script)
    assert params["ntasks_per_node"] == 7 and params["partition"] == "all"


def test_submitit_nodes_must_divide_the_world(tmp_path: Path) -> None:
    plan = make_plan(load_config(_config_file(tmp_path, ONE_PARTITION)).roles)
    assert (
        submitit_parameters(_spec("s"), _plan(("controller", 2, ""), ("env", 4, "")), 3)["ntasks_per_node"]
        == 2
    )
    with pytest.raises(UsageError, match="split evenly"):
        submitit_parameters(_spec("s"), plan, 2)


# --- the rendered script under a real shell ------------------------------------------------------------

# A stub step that stops "at a checkpoint" on SIGUSR2: it records the signal, takes a while (the
# checkpoint), records that it ended, and exits with STOP_STATUS. Sleeps are short so the trap runs soon.
STOPPING_STEP = """\
trap 'printf "step got USR2\\n" >> "$RECORD"; sleep 1; printf "step ended\\n" >> "$RECORD"; exit $STOP_STATUS' USR2
printf "step armed\\n" >> "$RECORD"
for _ in $(seq 300); do sleep 0.05; done
exit 9
"""


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _shell_fixture(
    tmp_path: Path, srun_body: str, job: str = "rl", restarts: int = 0
) -> tuple[Path, Path, dict[str, str]]:
    """A hostile run dir, stub srun/scontrol that record their argv (one per line), and the env to run."""
    run_dir = tmp_path / "a b" / 'it\'s "x" $HOME `id`'
    run_dir.mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "calls"
    _stub(bin_dir / "srun", f'printf "srun\\n" >> "{record}"; printf "%s\\n" "$@" >> "{record}"\n{srun_body}')
    _stub(bin_dir / "scontrol", f'printf "scontrol\\n" >> "{record}"; printf "%s\\n" "$@" >> "{record}"\n')
    mpi_env = run_dir / "mpi env.sh"
    mpi_env.write_text("export FROM_MPI_ENV=1\n")
    spec = JobSpec("x", run_dir, 5, 1, python="/usr/bin/python3", mpi_env=mpi_env, job=job)
    plan = _plan(("controller", 1, "p q"), ("trainer", 2, "t"))
    script = tmp_path / "job.sbatch"
    script.write_text(render_hetjob(spec, het_components(plan)))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_RESTART_COUNT": str(restarts),
        "RECORD": str(record),
        "STOP_STATUS": "0",
    }
    return script, record, env


def _run_script(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def _signal_once_step_runs(script: Path, record: Path, env: dict[str, str]) -> tuple[int, str]:
    """Start the script, send SIGUSR2 to the batch shell once the step runs; (exit status, stdout)."""
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not (record.exists() and "step armed" in record.read_text()):  # the stub's trap is installed
        assert time.monotonic() < deadline, "the stub step did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out


def test_rendered_script_passes_the_run_dir_verbatim_and_a_failed_step_is_not_requeued(
    tmp_path: Path,
) -> None:
    script, record, env = _shell_fixture(tmp_path, "exit 3\n")
    proc = _run_script(script, env)
    assert proc.returncode == 3, proc.stderr
    calls = record.read_text().splitlines()
    run_dir = str(tmp_path / "a b" / 'it\'s "x" $HOME `id`')
    assert calls == [
        "srun",
        "--mpi=pmix",
        "--het-group=0,1",
        "--kill-on-bad-exit=1",
        "--unbuffered",
        "/usr/bin/python3",
        "-m",
        "rollart_hpc.entry.worker",
        run_dir,
    ]
    assert "[slurm] step exited with status 3" in proc.stdout and "a rank failed or was killed" in proc.stdout
    assert "scontrol" not in record.read_text()
    assert "[0] rank 0 on p q: controller; [1] ranks 1-2 on t: trainer" in proc.stdout


def test_finished_run_exits_0_without_requeue(tmp_path: Path) -> None:
    script, record, env = _shell_fixture(tmp_path, 'touch "${*: -1}/summary.json"; exit 0\n')
    proc = _run_script(script, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[slurm] run finished" in proc.stdout and "scontrol" not in record.read_text()


def test_clean_stop_signalled_to_the_tasks_is_requeued_after_the_step(tmp_path: Path) -> None:
    # `scancel --signal=USR2 JOB` signals the tasks, not the batch shell: the step just exits 0 early.
    script, record, env = _shell_fixture(tmp_path, "exit 0\n")
    proc = _run_script(script, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert record.read_text().split("scontrol\n")[1].splitlines() == ["requeue", "77"]
    assert "the run stopped at a checkpoint: requeue job 77 (restart 1 of 1)" in proc.stdout


def test_usr2_is_forwarded_to_the_step_and_requeue_waits_for_it(tmp_path: Path) -> None:
    script, record, env = _shell_fixture(tmp_path, STOPPING_STEP)
    status, out = _signal_once_step_runs(script, record, env)
    assert status == 0, out
    after_argv = record.read_text().split("rollart_hpc.entry.worker\n", 1)[1].splitlines()[1:]
    assert after_argv == ["step armed", "step got USR2", "step ended", "scontrol", "requeue", "77"]
    assert "SIGUSR2 (preemption or time limit): forwarded to the step" in out
    assert "stopped at a checkpoint after SIGUSR2: requeue job 77 (restart 1 of 1)" in out


def test_stop_after_the_last_requeue_exits_75_without_requeue(tmp_path: Path) -> None:
    script, record, env = _shell_fixture(tmp_path, STOPPING_STEP, restarts=1)
    status, out = _signal_once_step_runs(script, record, env)
    assert status == 75, out
    assert "1 of 1 requeues are used: not requeued; continue it with 'scontrol requeue 77'" in out
    assert "scontrol" not in record.read_text()


def test_step_that_fails_after_usr2_is_not_requeued(tmp_path: Path) -> None:
    script, record, env = _shell_fixture(tmp_path, STOPPING_STEP)
    status, out = _signal_once_step_runs(script, record, {**env, "STOP_STATUS": "137"})
    assert status == 137, out
    assert "step exited with status 137" in out and "scontrol" not in record.read_text()


def test_job_without_checkpoints_ends_with_a_step_that_exits_0(tmp_path: Path) -> None:
    script, record, env = _shell_fixture(tmp_path, "exit 0\n", job="smoke")
    proc = _run_script(script, env)
    assert proc.returncode == 0 and "[slurm] run finished" in proc.stdout
    assert "scontrol" not in record.read_text()


# --- submitit tasks after a stop ------------------------------------------------------------------------


def _task_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int, restarts: int, worker_code: int = 0
) -> Path:
    """Stub scontrol on PATH, SLURM variables of task `rank`, and a `run_rank` that returns `worker_code`."""
    import rollart_hpc.entry.worker

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "calls"
    _stub(bin_dir / "scontrol", f'printf "%s\\n" "$@" >> "{record}"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", str(rank))
    monkeypatch.setenv("SLURM_JOB_ID", "88")
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
    monkeypatch.setattr(rollart_hpc.entry.worker, "run_rank", lambda run_dir: worker_code)
    return record


def test_worker_task_requeues_from_rank_0_after_a_stop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    record = _task_env(monkeypatch, tmp_path, rank=0, restarts=0)
    with pytest.raises(SystemExit) as stopped:
        submit.WorkerTask(str(tmp_path), "summary.json", 1)()
    assert stopped.value.code == 0 and record.read_text().splitlines() == ["requeue", "88"]


def test_worker_task_other_ranks_and_finished_runs_return(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    record = _task_env(monkeypatch, tmp_path, rank=3, restarts=0)
    assert submit.WorkerTask(str(tmp_path), "summary.json", 1)() == 0
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert submit.WorkerTask(str(tmp_path), None, 1)() == 0  # a job without checkpoints
    (tmp_path / "summary.json").write_text("{}")
    assert submit.WorkerTask(str(tmp_path), "summary.json", 1)() == 0
    assert not record.exists()


def test_worker_task_without_requeues_left_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    record = _task_env(monkeypatch, tmp_path, rank=0, restarts=2)
    with pytest.raises(RuntimeError, match="2 of 2 requeues are used: not requeued"):
        submit.WorkerTask(str(tmp_path), "summary.json", 2)()
    assert not record.exists()


def test_worker_task_failure_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _task_env(monkeypatch, tmp_path, rank=0, restarts=0, worker_code=1)
    with pytest.raises(RuntimeError, match="exited with code 1"):
        submit.WorkerTask(str(tmp_path), "summary.json", 2)()


def test_job_spec_knows_every_job_and_refuses_others() -> None:
    from rollart_hpc.cluster.sbatch import FINISH_MARKERS
    from rollart_hpc.entry.worker import JOBS

    assert set(FINISH_MARKERS) == set(JOBS)
    assert _spec("x").finish_marker == "summary.json" and _spec("x", job="smoke").finish_marker is None
    with pytest.raises(ValueError, match="no finish marker"):
        _spec("x", job="nosuch")


# --- the CLI module --------------------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_dry_run_prints_the_hetjob_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run dir"
    config = _config_file(tmp_path, TWO_PARTITIONS)
    assert submit.main(_args(str(config), "--dry-run", "--run-dir", str(run_dir), "--time-min", "7")) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and "#SBATCH --time=7" in out
    assert f"RUN_DIR={shlex.quote(str(run_dir))}" in out
    assert not run_dir.exists()


def test_dry_run_single_partition_prints_submitit_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config_file(tmp_path, ONE_PARTITION)
    assert (
        submit.main(
            _args(str(config), "roles.env.num_ranks=1", "--dry-run", "--run-dir", str(tmp_path / "r"))
        )
        == 0
    )
    out = capsys.readouterr().out
    params = json.loads(out[out.index("{") :])
    assert params["ntasks_per_node"] == 5 and params["partition"] == "all" and params["job_name"] == "single"


def test_bad_options_are_usage_errors(tmp_path: Path) -> None:
    config = str(_config_file(tmp_path, TWO_PARTITIONS))
    with pytest.raises(UsageError, match="--nodes applies"):
        submit.main(_args(config, "--dry-run", "--nodes", "2"))
    with pytest.raises(UsageError, match="--time-min"):
        submit.main(_args(config, "--dry-run", "--time-min", "0"))
    with pytest.raises(UsageError, match="percent"):
        submit.main(_args(config, "--dry-run", "--run-dir", str(tmp_path / "50%")))


def test_worker_task_pickles_by_reference() -> None:
    import cloudpickle

    task = submit.WorkerTask("/tmp/a b", "summary.json", 3)
    data = cloudpickle.dumps(task)
    assert b"rollart_hpc.entry.submit" in data and cloudpickle.loads(data) == task


def test_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, rollart_hpc.entry.submit, rollart_hpc.cluster.submission, rollart_hpc.cluster.sbatch; "
        "print(sorted(m for m in ('torch', 'mpi4py', 'submitit', 'megatron') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_rendered_hetjob_passes_shellcheck(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(_render(tmp_path, THREE_PARTITIONS))
    proc = subprocess.run(
        ["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shipped_sbatch_examples_pass_shellcheck() -> None:
    examples = sorted((ROOT / "slurm" / "examples").glob("*.sbatch"))
    assert examples, "no slurm/examples/*.sbatch"
    proc = subprocess.run(
        ["shellcheck", "-s", "bash", *map(str, examples)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout


# --- network settings ------------------------------------------------------------------------------------

NET = (
    "cluster.net.nccl_socket_ifname=ib0",
    "cluster.net.gloo_socket_ifname=eth1",
    "cluster.net.nccl_env={NCCL_IB_HCA = 'mlx5_0 mlx5_1', NCCL_DEBUG = 'WARN'}",
)
NET_EXPORTS = [
    "export PYTHONUNBUFFERED=1",
    "export NCCL_SOCKET_IFNAME=ib0",
    "export GLOO_SOCKET_IFNAME=eth1",
    "export NCCL_IB_HCA='mlx5_0 mlx5_1'",
    "export NCCL_DEBUG=WARN",
]


def test_network_settings_are_exported_by_the_hetjob_and_the_submitit_job(tmp_path: Path) -> None:
    """[cluster.net] becomes export lines of the job (the ranks inherit them); the submit host does not
    need the interfaces, the compute nodes do."""
    config = load_config(_config_file(tmp_path, TWO_PARTITIONS), list(NET))
    spec = submit.job_spec(config, HOSTILE_RUN_DIR, 30, 2)
    script = render_hetjob(spec, het_components(make_plan(config.roles)))
    start = script.index("export PYTHONUNBUFFERED=1")
    assert script[start:].splitlines()[: len(NET_EXPORTS)] == NET_EXPORTS
    single = load_config(_config_file(tmp_path, ONE_PARTITION), list(NET))
    params = submitit_parameters(submit.job_spec(single, HOSTILE_RUN_DIR, 30, 2), make_plan(single.roles), 1)
    assert params["setup"][: len(NET_EXPORTS)] == NET_EXPORTS
    plain = load_config(_config_file(tmp_path, TWO_PARTITIONS))
    assert submit.job_spec(plain, HOSTILE_RUN_DIR, 30, 2).env == ()


def test_signal_lead_is_rendered_from_the_config(tmp_path: Path) -> None:
    config = load_config(_config_file(tmp_path, TWO_PARTITIONS), ["cluster.signal_lead_s=300"])
    spec = submit.job_spec(config, HOSTILE_RUN_DIR, 30, 2)
    script = render_hetjob(spec, het_components(make_plan(config.roles)))
    assert "\n#SBATCH --signal=B:USR2@300\n" in script and "USR2@60" not in script
    assert "sends SIGUSR2 to this batch shell 300 s before the time limit" in script
    single = load_config(_config_file(tmp_path, ONE_PARTITION), ["cluster.signal_lead_s=90"])
    params = submitit_parameters(submit.job_spec(single, HOSTILE_RUN_DIR, 30, 2), make_plan(single.roles), 1)
    assert params["signal_delay_s"] == 90
    default = load_config(_config_file(tmp_path, TWO_PARTITIONS))
    assert submit.job_spec(default, HOSTILE_RUN_DIR, 30, 2).signal_delay_s == 60
    with pytest.raises(
        UsageError, match=r"^cluster\.signal_lead_s: 1800 s is not below the time limit \(--time-min 30\)"
    ):
        submit.job_spec(
            load_config(_config_file(tmp_path, TWO_PARTITIONS), ["cluster.signal_lead_s=1800"]),
            HOSTILE_RUN_DIR,
            30,
            2,
        )
    for bad in (0, -5):
        with pytest.raises(UsageError, match=rf"^cluster\.signal_lead_s: must be > 0, got {bad}$"):
            load_config(_config_file(tmp_path, TWO_PARTITIONS), [f"cluster.signal_lead_s={bad}"])
