"""scripts/gpu_check.sh on CPU: argument parsing, its dry mode, and the summary of results (fake parts)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
SUMMARY = REPO / "scripts" / "gpu_check_summary.py"


def _sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_bad_arguments_print_usage_and_exit_2() -> None:
    for args in ((), ("--dry",), ("out", "--nope"), ("a", "b", "c")):
        result = _sh(*args)
        assert result.returncode == 2 and "usage: scripts/gpu_check.sh OUT_DIR [--dry]" in result.stderr, args


def test_dry_mode_prints_every_part_within_ten_minutes(tmp_path: Path) -> None:
    result = _sh(str(tmp_path / "out dir"), "--dry")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "launch.py bench kernel --device cuda" in out and "-m gpu tests/test_kernels_policy_loss.py" in out
    assert "tests/test_train_trainer.py" in out and "scripts/gpu_train_memory.py --precision bf16" in out
    assert "tests/test_kernels_bench.py tests/test_train_lm_head.py >" in out  # the head's kernel, compiled
    assert (
        "configs/local.toml rollout.engine=vllm roles.rollout.gpus_per_rank=1 roles.trainer.gpus_per_rank=1"
        in out
    )
    assert "launch.py envs prepare" in out and "controller.eval_every_steps=0" in out
    assert "rollout.vllm.gpu_memory_utilization=0.45" in out
    assert (
        "controller.num_steps=3" in out
        and "scripts/gpu_vllm_check.py" in out
        and "gpu_check_summary.py" in out
    )
    limits = [int(x) for x in re.findall(r"\((\d+) s[,)]", out)]
    assert len(limits) == 4 and sum(limits) <= 10 * 60
    assert (tmp_path / "out dir").is_dir() and not any((tmp_path / "out dir").iterdir())


def test_the_run3_overrides_are_a_valid_config_with_trainer_and_rollout_on_one_gpu() -> None:
    from rollart_hpc.cluster.env import read_process_env
    from rollart_hpc.cluster.placement import place_rank
    from rollart_hpc.cluster.plan import make_plan
    from rollart_hpc.config import load_config

    dry = _sh("/tmp/gpu_check_dry", "--dry").stdout
    line = next(x for x in dry.splitlines() if x.startswith("run3"))
    overrides = [a for a in line.split() if "=" in a and not a.startswith(("--", '"'))]
    config = load_config(REPO / "configs" / "local.toml", overrides)
    plan = make_plan(config.roles)
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    gpus = {
        rank: place_rank(
            plan, rank, read_process_env({**env, "OMPI_COMM_WORLD_LOCAL_RANK": str(rank)}), 1, [], True
        ).gpu_ids
        for rank in range(plan.world_size)
    }
    assert gpus[plan.ranks_of("rollout")[0]] == ("0",) and gpus[plan.ranks_of("trainer")[0]] == ("0",)
    assert gpus[0] == () and config.controller.num_steps == 3 and config.rollout.engine == "vllm"


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _fake_results(out: Path, loaded: list[int]) -> None:
    entry = {"time_ms": 50.0, "tflops_8thv": 600.0, "peak_mem_gib": 3.5}
    _write(
        out / "kernel" / "bench_kernel.json",
        {"fused": entry, "eager": {**entry, "time_ms": 90.0}, "matmul_peak_tflops_bf16": 800.0},
    )
    _write(out / "run3" / "summary.json", {"wall_s": 120.0, "rollout_versions": {"1": loaded}})
    raw = {"raw_median_s": 0.01, "raw_GBps": 100.0, "receive_over_raw": 1.2, "total_over_raw": 1.5}
    _write(
        out / "vllm" / "gpu_vllm_check.json",
        {"bytes": 2**30, "update": {"total_s": 0.015}, "update_vs_raw": raw},
    )
    cells = [
        {"attention": a, "recompute": "none", "rows": 1, "tokens": 4096, "peak_mib": 9216.0, "step_s": 0.2}
        for a in ("sdpa", "unfused")
    ]
    _write(out / "trainer" / "train_memory.json", {"cells": [*cells, {**cells[1], "rows": 4, "oom": True}]})
    (out / "trainer" / "pytest_trainer.txt").write_text("....\n17 passed, 2 skipped in 41.20s\n")
    for part in ("kernel", "trainer", "run3", "vllm"):
        _write(out / f"{part}.status.json", {"part": part, "rc": 0, "wall_s": 10, "limit_s": 120})


def _summary(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SUMMARY), str(out)], capture_output=True, text=True, timeout=60
    )


def test_summary_table_of_a_passing_check(tmp_path: Path) -> None:
    _fake_results(tmp_path, [0, 1, 2, 3])
    result = _summary(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fused fwd+bwd T=32768 H=4096 V=151936" in result.stdout and "75% of peak" in result.stdout
    assert (
        "total/raw 1.50x" in result.stdout
        and "-> ok" in result.stdout
        and "gpu_check passed" in result.stdout
    )
    assert "17 passed, 2 skipped in 41.20s" in result.stdout and "9.0 GiB" in result.stdout
    assert re.search(r"train step unfused/none 4x4096 +out of memory", result.stdout)
    assert json.loads((tmp_path / "gpu_check.json").read_text())["ok"] is True


def test_summary_lists_skipped_parts_and_fails_a_failed_trainer_test(tmp_path: Path) -> None:
    _fake_results(tmp_path, [0, 1, 2, 3])
    for part in ("run3", "vllm"):
        _write(tmp_path / f"{part}.status.json", {"part": part, "skipped": "vllm is not importable: nope"})
    result = _summary(tmp_path)
    assert result.returncode == 0 and "skipped: vllm is not importable: nope" in result.stdout
    (tmp_path / "trainer" / "pytest_trainer.txt").write_text("F\n1 failed, 3 passed in 9.00s\n")
    assert _summary(tmp_path).returncode == 1


def test_summary_fails_on_too_few_weight_loads_or_a_missing_part(tmp_path: Path) -> None:
    _fake_results(tmp_path, [0, 1])
    result = _summary(tmp_path)
    assert result.returncode == 1 and "FEWER THAN 3 LOADS" in result.stdout
    _fake_results(tmp_path, [0, 1, 2, 3])
    (tmp_path / "vllm" / "gpu_vllm_check.json").unlink()
    result = _summary(tmp_path)
    assert result.returncode == 1 and "no result (vllm/gpu_vllm_check.json)" in result.stdout
