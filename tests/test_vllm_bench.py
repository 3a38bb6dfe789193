"""`bench engine --against hf,vllm` in the vLLM environment: the three engines on the same prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from rollart_hpc.models.tiny import make_tiny_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent


def test_bench_reports_the_ratio_against_vllm(tmp_path: Path) -> None:
    model = make_tiny_model(
        tmp_path / "model", family="llama", seed=3, hidden_size=128, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=64, intermediate_size=256, init_std=0.08,
    )  # fmt: skip
    out = tmp_path / "engine.json"
    cmd = [sys.executable, str(REPO / "launch.py"), "bench", "engine", "--model", str(model),
           "--batch", "4", "--max-tokens", "8", "--repeats", "2", "--threads", "1",
           "--against", "hf,vllm", "--json", str(out)]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["vllm_tok_s"] > 0 and result["ratio_vs_vllm"] > 0
    assert len(result["ratio_vs_vllm_per_repeat"]) == 2
    # greedy on the same weights: the engines agree on the leading tokens (fp32, near-ties aside)
    assert result["greedy_agreement_vs_vllm"] > 0.5
