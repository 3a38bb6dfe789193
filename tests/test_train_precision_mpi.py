"""A bf16 RL run end to end (`configs/tiny.toml trainer.precision=bf16`): the resolved config, the trainer
publishing bf16 weights (half the bytes of fp32), the rollout engine running in bf16."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_bf16_run_publishes_and_serves_bf16_weights(tmp_path: Path) -> None:
    from safetensors import safe_open

    run_dir = tmp_path / "bf16"
    cmd = [sys.executable, "launch.py", "run", "configs/tiny.toml", "trainer.precision=bf16"]
    result = subprocess.run(
        [*cmd, "--run-dir", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert 'precision = "bf16"' in (run_dir / "config.resolved.toml").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    published = {row["weights_bytes"] for row in rows}
    assert [row["step"] for row in rows] == [0, 1, 2] and len(published) == 1
    # The warm model the trainer wrote is the first version the engines load: bf16 on disk too.
    with safe_open(str(run_dir / "model" / "warm" / "model.safetensors"), "pt") as f:
        tensors = [f.get_tensor(name) for name in f.keys()]  # noqa: SIM118 (safe_open is no mapping)
    assert tensors and all(str(t.dtype) == "torch.bfloat16" for t in tensors)
    fp32_bytes = sum(t.numel() * 4 for t in tensors)
    assert published == {fp32_bytes / 2}
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank-*.log"))
    assert "builtin engine ready" in logs and "8 slots, bfloat16" in logs
