"""`launch.py sweep`: grid expansion and names, bad arguments, resumability, the array script, one real sweep.

The real local sweep runs configs/tiny.toml twice (two values of algo.rho, one seed, 2 steps, 1 SFT step)
through the CLI, then again to check that finished runs are skipped, and compares them. The `slurm` tests
(local test cluster, `bash slurm/up.sh`) submit a 2-run sweep as one job array, and stop a 1-run array's
element with USR2 (it checkpoints, requeues itself and finishes); tiny.toml's 5 ranks do not fit the
4-core default partition (refused before sbatch, also tested), so every role goes to `all` (both nodes). Golden file:
tests/golden/sweep_array.sbatch (`UPDATE_GOLDEN=1` regenerates it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_logs import job_log

from rollart_hpc.cluster.sbatch import HetComponent, render_array_job
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry.cli import main as cli_main
from rollart_hpc.sweep import grid as sweep_grid
from rollart_hpc.sweep import local as sweep_local
from rollart_hpc.sweep import run as sweep_run

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
FAST = ["--set", "controller.num_steps=2", "--set", "trainer.sft_steps=1"]
EVAL = ["--set", "controller.eval_every_steps=2"]  # evaluation rounds at versions 0 and 2
ROLES = ("controller", "rollout", "env", "reward", "trainer")
# sweep arguments that put every role on the test cluster's partition "all"
ON_PARTITION_ALL = tuple(arg for role in ROLES for arg in ("--set", f"roles.{role}.partition=all"))
NEEDS_SLURM_CLIENT = pytest.mark.skipif(
    shutil.which("sinfo") is None, reason="sinfo not on PATH: no SLURM client installed"
)


def test_grid_expands_to_the_product_times_seeds_with_readable_names() -> None:
    grid = sweep_grid.parse_grid(["algo.rho=0.8,0.9", "controller.mode=sync,async"])
    runs = sweep_grid.expand(grid, sweep_grid.parse_seeds("0,1"))
    assert len(runs) == 8
    assert runs[0].name == "algo.rho=0.8__controller.mode=sync/seed=0"
    assert runs[-1].name == "algo.rho=0.9__controller.mode=async/seed=1"
    assert runs[0].overrides == ("algo.rho=0.8", "controller.mode=sync", "run.seed=0")
    assert [r.name for r in sweep_grid.expand([], [3])] == ["base/seed=3"]


def test_values_split_outside_brackets_and_names_are_slugged() -> None:
    assert sweep_grid.split_values("['a','b'],['c']") == ["['a','b']", "['c']"]
    assert sweep_grid.split_values('"x,y",z') == ['"x,y"', "z"]
    run = sweep_grid.expand(sweep_grid.parse_grid(["envs.families=['calc_math']"]), [0])[0]
    assert run.arm == "envs.families=__calc_math__"
    assert run.overrides[0] == "envs.families=['calc_math']"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grid", "algo.rho"], "expected KEY=V1,V2"),
        (["--grid", "algo.rho="], "empty value"),
        (["--grid", "algo.rho=0.8,,0.9"], "empty value"),
        (["--grid", "algo.nosuch=1,2"], "unknown key algo.nosuch"),
        (["--grid", "algo.rho=0.8", "--grid", "algo.rho=0.9"], "given twice"),
        (["--grid", "run.seed=1,2"], "--seeds"),
        (["--seeds", "0,x"], "integers"),
        (["--parallel", "0"], "--parallel must be >= 1"),
        (["--set", "algo.rho=0.8", "--grid", "algo.rho=0.9"], "swept"),
        (["--shared-warm-start", "--grid", "trainer.sft_steps=1,2"], "changes the warm start"),
        (["--shared-warm-start", "--grid", "model.hidden_size=64,128"], "changes the warm start"),
        (["--shared-warm-start", "--slurm"], "not with --slurm"),
    ],
)
def test_bad_arguments_are_one_line_errors_with_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(["sweep", str(REPO / "configs" / "tiny.toml"), "--out", str(tmp_path / "s"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "s").exists()


def _make(run_dir: Path, *names: str) -> None:
    run_dir.mkdir(parents=True)
    for name in names:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text("x")


def test_run_state_finished_resume_fresh(tmp_path: Path) -> None:
    _make(tmp_path / "done", "config.resolved.toml", "metrics.jsonl", "summary.json")
    _make(tmp_path / "ckpt", "config.resolved.toml", "checkpoints/step-2/COMPLETE")
    _make(tmp_path / "started", "config.resolved.toml", "metrics.jsonl")
    _make(tmp_path / "config-only", "config.resolved.toml")
    assert sweep_grid.run_state(tmp_path / "done", "summary.json") == sweep_grid.FINISHED
    assert sweep_grid.run_state(tmp_path / "ckpt", "summary.json") == sweep_grid.RESUME
    assert sweep_grid.run_state(tmp_path / "started", "summary.json") == sweep_grid.RESUME
    assert sweep_grid.run_state(tmp_path / "config-only", "summary.json") == sweep_grid.FRESH
    assert sweep_grid.run_state(tmp_path / "absent", "summary.json") == sweep_grid.FRESH


def test_commands_run_fresh_and_resume_interrupted(tmp_path: Path) -> None:
    run = sweep_grid.expand(sweep_grid.parse_grid(["algo.rho=0.8"]), [1])[0]
    fresh = sweep_grid.run_command("c.toml", ["a.b=1"], run, tmp_path, sweep_grid.FRESH, 2)
    assert fresh[1:] == [
        "-m",
        "rollart_hpc.entry.cli",
        "run",
        "c.toml",
        "a.b=1",
        "algo.rho=0.8",
        "run.seed=1",
    ] + [
        "--run-dir",
        str(tmp_path / run.name),
        "--max-restarts",
        "2",
    ]
    resume = sweep_grid.run_command("c.toml", [], run, tmp_path, sweep_grid.RESUME, 0)
    assert resume[3:] == ["resume", str(tmp_path / run.name), "--max-restarts", "0"]


def test_rerun_skips_finished_resumes_interrupted_and_starts_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollart_hpc.config import load_config, write_resolved

    config, out = str(REPO / "configs" / "tiny.toml"), tmp_path / "s"
    for seed, files in ((0, ("summary.json", "metrics.jsonl")), (1, ("checkpoints/step-1/COMPLETE",))):
        run_dir = out / f"base/seed={seed}"
        write_resolved(load_config(config, [f"run.seed={seed}"]), run_dir)
        for name in files:
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / name).write_text("x")
    seen: dict[str, list[str]] = {}

    def fake_run_local(out_dir: Path, names: list[str], commands: dict[str, list[str]], parallel: int) -> int:
        seen.update(commands)
        return 0

    monkeypatch.setattr(sweep_run, "run_local", fake_run_local)
    assert cli_main(["sweep", config, "--seeds", "0,1,2", "--out", str(out), "--parallel", "3"]) == 0
    assert set(seen) == {"base/seed=1", "base/seed=2"}
    assert seen["base/seed=1"][3:5] == ["resume", str(out / "base/seed=1")]
    assert seen["base/seed=2"][3:5] == ["run", config]
    states = capsys.readouterr().out
    assert "base/seed=0" in states and "finished" in states and "resume" in states and "fresh" in states
    assert [r["seed"] for r in sweep_grid.read_sweep_runs(out)] == [0, 1, 2]


def test_run_dir_made_with_another_config_is_refused(tmp_path: Path) -> None:
    from rollart_hpc.config import load_config, write_resolved

    config = str(REPO / "configs" / "tiny.toml")
    runs = sweep_grid.expand(sweep_grid.parse_grid(["algo.rho=0.8"]), [0])
    write_resolved(load_config(config, ["algo.rho=0.7", "run.seed=0"]), tmp_path / runs[0].name)
    with pytest.raises(UsageError, match="another config"):
        sweep_grid.resolve_runs(config, [], runs, tmp_path)
    assert set(
        sweep_grid.resolve_runs(config, ["algo.rho=0.7"], sweep_grid.expand([], [0]), tmp_path / "x")
    ) == {"base/seed=0"}


def test_local_runs_continue_after_a_failure_and_report_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ok = [sys.executable, "-c", "print('fine')"]
    bad = [sys.executable, "-c", "import sys; print('broken'); sys.exit(3)"]
    code = sweep_local.run_local(
        tmp_path, ["a/seed=0", "b/seed=0", "c/seed=0"], {"a/seed=0": bad, "b/seed=0": ok, "c/seed=0": ok}, 2
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "a/seed=0 FAILED (exit 3)" in out and str(tmp_path / "a/seed=0" / "sweep.log") in out
    assert "2 finished, 1 failed: a/seed=0" in out
    assert (tmp_path / "b/seed=0" / "sweep.log").read_text() == "fine\n"


def test_golden_array_script_with_hostile_paths() -> None:
    out = Path('/scratch/sweep it\'s "q"')
    component = HetComponent("all", 0, 5, ROLES, cpus_per_task=1)
    script = render_array_job(
        "tiny-sweep", out, [out / "algo.rho=0.8/seed=0", out / "algo.rho=0.9/seed=0"], component, 30
    )
    path = GOLDEN / "sweep_array.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(script)
    assert script == path.read_text()
    assert "#SBATCH --array=0-1" in script and "#SBATCH --partition=all" in script
    with pytest.raises(UsageError, match="percent"):
        render_array_job("x", Path("/a%b"), [Path("/a%b/r")], component, 30)


def test_array_script_runs_the_element_s_job_script(tmp_path: Path) -> None:
    """Element 1 of the rendered array execs RUN_DIR/job.sbatch of the second run dir, output in the run dir."""
    dirs = [tmp_path / "r 0", tmp_path / "r'1"]
    for index, run_dir in enumerate(dirs):
        run_dir.mkdir()
        (run_dir / "job.sbatch").write_text(f'echo "element {index} in $PWD"; exit 7\n')
    script = tmp_path / "array.sbatch"
    script.write_text(render_array_job("x", tmp_path, dirs, HetComponent("", 0, 1, ("controller",)), 5))
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "40"}
    proc = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode == 7, proc.stderr
    assert "element 1 (job 42)" in proc.stdout
    assert (dirs[1] / "slurm-42.out").read_text().startswith("element 1")


def test_slurm_refuses_roles_on_several_partitions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sweep", str(REPO / "configs" / "tiny.toml"), "--out", str(tmp_path / "s"), "--slurm"]
    argv += ["--set", "roles.trainer.partition=train", "--grid", "algo.rho=0.8,0.9"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "one partition" in err and err.count("\n") == 1, err


# --- real runs ----------------------------------------------------------------------------------------


def _cli(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "launch.py", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.mpi
def test_local_sweep_of_tiny_runs_every_arm_and_skips_finished_runs(tmp_path: Path) -> None:
    """With --shared-warm-start: one warm-start run, and both arms start from its warm model."""
    out = tmp_path / "sweep"
    argv = ["sweep", "configs/tiny.toml", "--grid", "algo.rho=0.8,0.9", "--seeds", "0", "--out", str(out),
            "--shared-warm-start"]  # fmt: skip
    start = time.monotonic()
    proc = _cli(*argv, *FAST, *EVAL)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = ["algo.rho=0.8/seed=0", "algo.rho=0.9/seed=0"]
    listing = json.loads((out / "sweep.json").read_text())
    assert [r["name"] for r in listing["runs"]] == names
    warm = out / "warm" / "seed=0" / "model" / "warm"
    assert (out / "warm" / "seed=0" / "summary.json").exists() and (warm / "COMPLETE").exists()
    for name, rho in zip(names, (0.8, 0.9), strict=True):
        assert (out / name / "summary.json").exists()
        resolved = (out / name / "config.resolved.toml").read_text()
        assert f"rho = {rho}" in resolved and f'path = "{warm}"' in resolved and "sft_steps = 0" in resolved
        assert not (out / name / "model" / "init").exists()  # no model of its own: the warm one
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r.get("kind") != "eval"] == [0, 1]
    again = _cli(*argv, *FAST, *EVAL)
    assert again.returncode == 0 and "every run has finished" in again.stdout, again.stdout + again.stderr
    compared = _cli("compare", str(out), "--json", str(tmp_path / "c.json"))
    assert compared.returncode == 0, compared.stderr
    arms = json.loads((tmp_path / "c.json").read_text())["arms"]
    assert set(arms) == {"algo.rho=0.8", "algo.rho=0.9"}
    assert all(arm["eval_from_train"] == [] for arm in arms.values())  # eval rounds at versions 0 and 2
    print(f"local sweep of 2 tiny runs: {took:.1f}s")


@pytest.mark.slurm
@pytest.mark.slow
@NEEDS_SLURM_CLIENT
def test_slurm_sweep_is_one_job_array(tmp_path: Path) -> None:
    out = tmp_path / "array sweep"
    argv = [
        "sweep",
        "configs/tiny.toml",
        "--grid",
        "algo.rho=0.8,0.9",
        "--out",
        str(out),
        "--slurm",
        *FAST,
        *ON_PARTITION_ALL,
    ]
    start = time.monotonic()
    proc = _cli(
        *argv,
        "--set",
        "cluster.peer_timeout_s=300",
        "--set",
        "controller.eval_every_steps=0",
        "--time-min",
        "20",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = json.loads((out / "sweep.json").read_text())["slurm"][0]["job_id"]
    names = ["algo.rho=0.8/seed=0", "algo.rho=0.9/seed=0"]
    _wait_gone(job_id, 900)
    for index, name in enumerate(names):
        logs = "".join(job_log(p) for p in (out / name).glob("slurm-*.out"))
        assert (out / name / "summary.json").exists(), logs[-3000:]
        assert "[slurm] run finished" in logs
        assert json.loads((out / name / "slurm_job.json").read_text())["job_id"] == f"{job_id}_{index}"
    print(f"slurm sweep, 2-element job array: {time.monotonic() - start:.1f}s")


@pytest.mark.slurm
@NEEDS_SLURM_CLIENT
def test_slurm_sweep_that_does_not_fit_its_partition_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tiny.toml's 5 ranks on the default partition (rollout1, 4 CPUs): refused before sbatch."""
    argv = ["sweep", str(REPO / "configs" / "tiny.toml"), "--out", str(tmp_path / "s"), "--slurm"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "needs 5 CPUs" in err and err.count("\n") == 1, err
    assert not (tmp_path / "s" / "array.sbatch").exists()


def _wait_gone(job_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        while subprocess.run(
            ["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30
        ).stdout.strip():
            assert time.monotonic() < deadline, f"job {job_id} not done after {timeout_s:.0f}s"
            time.sleep(1.0)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)


@pytest.mark.slurm
@pytest.mark.slow
@NEEDS_SLURM_CLIENT
def test_slurm_array_element_stopped_by_usr2_is_requeued_and_resumes(tmp_path: Path) -> None:
    """Preemption of an element (`scancel --signal=USR2`): it checkpoints, requeues itself and finishes.

    The signal goes out once 2 steps are in; the 38 left take over 10 s on a quiet box (0.3 s a step), over
    10 times what seeing the rows (polled every 0.5 s) and sending the signal take."""
    out, num_steps = tmp_path / "pre", 40
    sets = list(ON_PARTITION_ALL)
    sets += ["--set", f"controller.num_steps={num_steps}", "--set", "trainer.sft_steps=1"]
    sets += ["--set", "controller.checkpoint_every_steps=0"]  # the signal's checkpoint only
    sets += ["--set", "controller.eval_every_steps=0", "--set", "cluster.peer_timeout_s=300"]
    start = time.monotonic()
    proc = _cli("sweep", "configs/tiny.toml", "--out", str(out), "--slurm", *sets, "--time-min", "20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = json.loads((out / "sweep.json").read_text())["slurm"][0]["job_id"]
    metrics = out / "base/seed=0" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
            raise AssertionError("no step trained after 600s")
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    _wait_gone(job_id, 600)
    log = "".join(job_log(p) for p in (out / "base/seed=0").glob("slurm-*.out"))
    assert "the run stopped at a checkpoint: requeue job" in log and "restart 1 on" in log, log[-3000:]
    assert "resumed from" in log and "[slurm] run finished" in log, log[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(num_steps))
    print(f"slurm array element stopped, requeued and finished: {time.monotonic() - start:.1f}s")
