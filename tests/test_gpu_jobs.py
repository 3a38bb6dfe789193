"""GPU jobs without a cluster: per-role resources in the config, the requests a job renders (golden files,
slurm/examples/ kept in step with the renderer), dry runs that print every rank's device, `--out` scripts.

Regenerate golden files and examples with `UPDATE_GOLDEN=1 pytest tests/test_gpu_jobs.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollart_hpc.cluster import submission
from rollart_hpc.cluster.plan import make_plan
from rollart_hpc.cluster.sbatch import (
    JobSpec,
    check_gpus_fit,
    het_components,
    render_hetjob,
    render_job,
    single_component,
    submitit_parameters,
)
from rollart_hpc.config import load_config
from rollart_hpc.config.loader import build
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry import submit

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
EXAMPLES = REPO / "slurm" / "examples"
HOSTILE_RUN_DIR = Path('/tmp/a b/it\'s "gpu"')
EXAMPLE_ROOT = "/path/to/rollart_hpc"

MULTI_NODE_GPU = """\
[run]
name = "gpu multi"
job = "rl"
[roles.controller]
partition = "infer"
ranks_per_node = 4
cpus_per_rank = 2
mem_gb = 8
[roles.rollout]
num_ranks = 5
partition = "infer"
ranks_per_node = 4
gpus_per_rank = 2
cpus_per_rank = 6
mem_gb = 40
gpu_type = "h200"
constraint = "h200&ib"
sbatch_extra = ["--account=proj_x", "--qos=high", "--exclusive"]
[roles.env]
partition = "infer"
[roles.reward]
partition = "infer"
[roles.trainer]
num_ranks = 8
partition = "train"
ranks_per_node = 4
gpus_per_rank = 1
cpus_per_rank = 10
mem_gb = 100
sbatch_extra = ["--account=proj_x"]
"""


def _config(tmp_path: Path, text: str = MULTI_NODE_GPU, *overrides: str) -> Config:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return load_config(path, overrides)


def _check(path: Path, text: str) -> None:
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing; run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{path.name} differs from the renderer; UPDATE_GOLDEN=1 regenerates it"


# --- the config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("roles.trainer.gpus_per_rank=-1", r"^roles\.trainer\.gpus_per_rank: must be >= 0, got -1$"),
        ("roles.env.mem_gb=-2", r"^roles\.env\.mem_gb: must be >= 0"),
        ("roles.rollout.gpu_type='h 100'", r"^roles\.rollout\.gpu_type: 'h 100' must be one word"),
        ("roles.env.gpu_type=h100", r"^roles\.env\.gpu_type: set, but roles\.env\.gpus_per_rank is 0"),
        ("roles.env.constraint='a b'", r"^roles\.env\.constraint: 'a b' is not a SLURM feature expression"),
        (
            "roles.env.sbatch_extra=['account=x']",
            r"^roles\.env\.sbatch_extra: 'account=x' is not of the form",
        ),
        (
            "roles.env.sbatch_extra=['--mem=4G']",
            r"^roles\.env\.sbatch_extra: '--mem=4G' sets --mem, which submit",
        ),
        (
            "roles.trainer.cpus_per_rank=2",
            r"^trainer\.num_threads: 4 threads exceed roles\.trainer\.cpus_per_rank = 2$",
        ),
        (
            "rollout.tensor_parallel_size=2",
            r"^rollout\.tensor_parallel_size: 2 needs roles\.rollout\.gpus_per_rank >= 2",
        ),
    ],
)
def test_resource_fields_are_validated_in_one_line(tmp_path: Path, override: str, message: str) -> None:
    base = "[run]\njob = 'rl'\n[trainer]\nnum_threads = 4\n[rollout]\nengine = 'vllm'\n[roles.rollout]\ngpus_per_rank = 1\n"
    with pytest.raises(UsageError) as info:
        _config(tmp_path, base, override)
    assert re.search(message, str(info.value)) and "\n" not in str(info.value), str(info.value)


def test_defaults_ask_for_nothing() -> None:
    roles = build(Config, {}).roles
    for name in ("controller", "rollout", "env", "reward", "trainer"):
        role = getattr(roles, name)
        assert (role.gpus_per_rank, role.cpus_per_rank, role.mem_gb, role.ranks_per_node) == (0, 0, 0, 0)


@pytest.mark.parametrize("name", ["gpu_node8.toml", "gpu_2partitions.toml"])
def test_shipped_gpu_configs_name_their_model_and_hardware(name: str) -> None:
    text = (REPO / "configs" / name).read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    config = load_config(REPO / "configs" / name)
    assert config.model.source == "path" and Path(config.model.path).name in header
    assert "H100/H200" in header and "GPU" in header
    assert config.roles.rollout.gpus_per_rank and config.roles.trainer.gpus_per_rank
    assert config.rollout.engine == "vllm"
    assert not any(getattr(config.roles, r).gpus_per_rank for r in ("controller", "env", "reward"))


# --- rendered requests --------------------------------------------------------------------------------


def test_components_request_gpus_cpus_and_memory_per_node(tmp_path: Path) -> None:
    plan = make_plan(_config(tmp_path).roles)
    infer, train = het_components(plan)
    # infer, 4 ranks per node: node 0 = controller + 3 rollouts (6 GPUs, 128G), node 1 = 3 rollouts + env
    assert (infer.num_nodes, infer.tasks_per_node, infer.gpus_per_node) == (2, 4, 6)
    assert (infer.cpus_per_task, infer.mem_gb_per_node, infer.gpu_type) == (6, 128, "h200")
    assert (train.num_nodes, train.gpus_per_node, train.cpus_per_task, train.mem_gb_per_node) == (
        2,
        4,
        10,
        400,
    )


def test_golden_multi_node_gpu_hetjob(tmp_path: Path) -> None:
    plan = make_plan(_config(tmp_path).roles)
    spec = JobSpec(
        "gpu multi",
        HOSTILE_RUN_DIR,
        30,
        2,
        python="/opt/r/.venv/bin/python",
        mpi_env=Path("/opt/r/m.sh"),
        job="rl",
    )
    script = render_hetjob(spec, het_components(plan))
    _check(GOLDEN / "hetjob_gpu_multinode.sbatch", script)
    assert "#SBATCH --gres=gpu:h200:6" in script and "#SBATCH --gres=gpu:4" in script
    assert "#SBATCH --account=proj_x" in script and "#SBATCH --exclusive" in script
    assert "#SBATCH --constraint='h200&ib'" in script


def test_roles_of_one_component_must_agree_on_its_node_layout(tmp_path: Path) -> None:
    config = _config(tmp_path, MULTI_NODE_GPU, "roles.controller.ranks_per_node=2")
    with pytest.raises(
        UsageError, match=r"roles\.controller\.ranks_per_node = 2, roles\.rollout\.ranks_per_node = 4"
    ):
        het_components(make_plan(config.roles))
    config = _config(
        tmp_path, MULTI_NODE_GPU, "roles.controller.ranks_per_node=0", "roles.rollout.num_ranks=4"
    )
    with pytest.raises(UsageError, match="share a job component of 7 ranks, which do not fill nodes of 4"):
        het_components(make_plan(config.roles))


def test_submitit_gets_the_same_requests(tmp_path: Path) -> None:
    text = MULTI_NODE_GPU.replace('"train"', '"infer"').replace("ranks_per_node = 4\n", "")
    plan = make_plan(_config(tmp_path, text, "roles.trainer.sbatch_extra=[]").roles)
    spec = JobSpec("s", HOSTILE_RUN_DIR, 30, 2, job="rl")
    params = submitit_parameters(spec, plan, nodes=2)
    # node 0: controller, 5 rollout ranks (10 GPUs), env, reward; node 1: 8 trainers (8 GPUs, 800G)
    assert params["ntasks_per_node"] == 8 and params["gres"] == "gpu:h200:10"
    assert params["cpus_per_task"] == 10 and params["mem"] == "800G" and params["constraint"] == "h200&ib"
    assert params["additional_parameters"] == {
        "requeue": True,
        "account": "proj_x",
        "qos": "high",
        "exclusive": True,
    }
    with pytest.raises(UsageError, match=r"roles\.trainer\.ranks_per_node: a single-partition job places 8"):
        submitit_parameters(
            spec, make_plan(_config(tmp_path, text, "roles.trainer.ranks_per_node=4").roles), 2
        )


def test_a_component_asking_more_gpus_than_a_node_has_is_refused_in_one_line(tmp_path: Path) -> None:
    components = het_components(make_plan(_config(tmp_path).roles))
    check_gpus_fit(components, {"infer": 8, "train": 8})
    with pytest.raises(
        UsageError,
        match=r"^roles trainer ask 4 GPUs per node on partition 'train', whose nodes have at most 2;",
    ):
        check_gpus_fit(components, {"infer": 8, "train": 2})


# --- examples and dry runs ----------------------------------------------------------------------------


def _example_spec(config: Config) -> JobSpec:
    return JobSpec(
        config.run.name,
        Path(f"{EXAMPLE_ROOT}/runs/{config.run.name}"),
        60,
        3,
        python=f"{EXAMPLE_ROOT}/.venv/bin/python",
        mpi_env=Path(f"{EXAMPLE_ROOT}/slurm/mpi_env.sh"),
        job=config.run.job,
        max_restarts=config.cluster.max_restarts,  # what `submit` renders
    )


@pytest.mark.parametrize("name", ["gpu_node8", "gpu_2partitions", "gpu_2pools", "gpu_2x8_qwen7b"])
def test_examples_are_in_step_with_the_renderer(name: str) -> None:
    config = load_config(REPO / "configs" / f"{name}.toml")
    plan = make_plan(config.roles)
    components = het_components(plan) if len(het_components(plan)) > 1 else (single_component(plan, 1),)
    text = submission.job_text(plan, components, render_job(_example_spec(config), components))
    _check(EXAMPLES / f"{name}.sbatch", text)


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_submit_dry_run_of_the_two_partition_config_requests_resources_and_one_gpu_per_rank(
    tmp_path: Path,
) -> None:
    result = _run_cli("submit", "configs/gpu_2partitions.toml", "--dry-run", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for option in (
        "--gres=gpu:8",
        "--cpus-per-task=8",
        "--cpus-per-task=12",
        "--mem=528G",
        "--mem=768G",
        "--nodes=2",
    ):
        assert f"#SBATCH {option}\n" in out
    ranks = re.findall(
        r"^#   rank (\d+)\s+(\w+)\s+node (\S+)\s+local \d+\s+(GPU (\S+) -> cuda:0|cpu)", out, re.M
    )
    assert [int(r[0]) for r in ranks] == list(range(34))
    gpus = [(node, gpu) for _, _, node, _, gpu in ranks if gpu]
    assert len(gpus) == 30 and len(set(gpus)) == 30  # one device per GPU rank, none shared within a node
    assert {role for _, role, _, dev, _ in ranks if dev == "cpu"} == {"controller", "env", "reward"}
    assert not (tmp_path / "r").exists()


def test_run_dry_run_prints_every_ranks_device() -> None:
    result = _run_cli("run", "configs/gpu_node8.toml", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "rank 8   trainer    node localhost      local 8   GPU 4 -> cuda:0" in result.stdout
    assert "rank 0   controller node localhost      local 0   cpu" in result.stdout


def test_dry_run_out_writes_a_script_that_sbatch_takes_as_is(tmp_path: Path) -> None:
    out, run_dir = tmp_path / "job.sbatch", tmp_path / "run"
    args = argparse.ArgumentParser()
    submit.add_arguments(args)
    ns = args.parse_args(
        [str(REPO / "configs" / "gpu_node8.toml"), "--dry-run", "--out", str(out), "--run-dir", str(run_dir)]
    )
    assert submit.main(ns) == 0
    script = out.read_text()
    assert (
        script.startswith("#!/bin/bash")
        and "--het-group=0" not in script
        and "#SBATCH --gres=gpu:8" in script
    )
    assert "srun --mpi=pmix --kill-on-bad-exit=1" in script and "# placement" in script
    assert (run_dir / "config.resolved.toml").exists()
    assert subprocess.run(["bash", "-n", str(out)], check=False).returncode == 0
    with pytest.raises(UsageError, match="add --dry-run"):
        submit.main(args.parse_args([str(REPO / "configs" / "gpu_node8.toml"), "--out", str(out)]))


def test_submitit_dry_run_keeps_its_json_parseable(tmp_path: Path) -> None:
    result = _run_cli("submit", "configs/gpu_node8.toml", "--dry-run", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 0, result.stderr
    params = json.loads(result.stdout[result.stdout.index("{") :])
    assert params["gres"] == "gpu:8" and params["cpus_per_task"] == 8 and params["ntasks_per_node"] == 12
