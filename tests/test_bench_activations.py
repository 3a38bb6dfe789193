"""`bench activations` and scripts/gpu_train_memory.py on CPU: argument checks and one real cell."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rollart_hpc.bench import activations
from rollart_hpc.contracts.errors import UsageError

REPO = Path(__file__).resolve().parent.parent


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    activations.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bad_cells_and_shapes_are_usage_errors() -> None:
    for argv, flag in (
        (("--attention", "sdpa,flash"), "--attention"),
        (("--recompute", "some"), "--recompute"),
        (("--micro-batches", "4x"), "--micro-batches"),
        (("--heads", "3"), "--heads"),
    ):
        with pytest.raises(UsageError, match=flag):
            activations.resolve(_args(*argv), cuda=False)
    with pytest.raises(UsageError, match="--device cuda"):
        activations.resolve(_args("--device", "cuda"), cuda=False)
    spec = activations.resolve(_args("--micro-batches", "1x2048,4x512", "--recompute", "full"), cuda=False)
    assert (spec["micro_batches"], spec["recompute"], spec["device"]) == (
        [(1, 2048), (4, 512)],
        ["full"],
        "cpu",
    )


def test_the_bench_module_imports_no_torch() -> None:
    code = "import sys, rollart_hpc.bench.activations; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


@pytest.mark.slow  # a fresh interpreter importing torch and Megatron for the cell: 5-15 s here
def test_the_gpu_script_runs_a_toy_cell_on_cpu(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "gpu_train_memory", REPO / "scripts" / "gpu_train_memory.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.QWEN25_15B["hidden"] == 1536 and script.QWEN25_15B["layers"] == 28
    out = tmp_path / "mem.json"
    toy = ["--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--ffn", "128"]
    argv = [*toy, "--vocab", "512", "--tokens", "64", "--attention", "sdpa", "--recompute", "full"]
    assert script.main(["--device", "cpu", "--repeats", "1", "--out", str(out), *argv]) == 0
    result = json.loads(out.read_text())
    assert result["spec"]["model"]["vocab"] == 512 and result["spec"]["precision"] == "fp32"
    (cell,) = result["cells"]
    assert (cell["attention"], cell["recompute"], cell["rows"], cell["tokens"]) == ("sdpa", "full", 1, 64)
    assert cell["peak_rss_mib_above_start"] > 0 and cell["step_s"] > 0
    assert abs(cell["loss"] - math.log(512)) < 0.5  # near-uniform predictions of a small random init
