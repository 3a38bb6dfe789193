"""`bench engine`: argument errors, and a small run with household episodes, the prefix cache and the
profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(REPO / "launch.py"), "bench", "engine", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--against", "hf,sglang"], "--against: a comma list of hf (always) and vllm"),
        (["--episodes", "-1"], "--episodes must be >= 0"),
    ],
)
def test_bad_arguments_are_one_line_errors(args: list[str], message: str) -> None:
    proc = _bench(*args, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_vllm_outside_its_environment_is_named() -> None:
    pytest.importorskip("transformers")
    try:
        import vllm  # noqa: F401
    except ImportError:
        proc = _bench("--against", "hf,vllm", timeout=120)
        assert proc.returncode == 2 and ".venv-vllm/bin/python" in proc.stderr
    else:
        pytest.skip("vLLM is installed here")


@pytest.mark.slow
def test_small_bench_with_household_episodes(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    proc = _bench("--model", "tiny", "--batch", "2", "--max-tokens", "4", "--episodes", "2",
                  "--threads", "1", "--profile", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ratio"] > 0 and result["engine_tok_s"] > 0 and "ratio_vs_vllm" not in result
    prefix = result["prefix_cache"]
    cached, plain = prefix["cached"], prefix["plain"]
    assert cached["turns"] > 2 and cached["tokens_reused"] > 0 and plain["tokens_reused"] == 0
    # every turn after an episode's first finds the episode so far in the cache
    assert prefix["prefill_tokens_saved_fraction"] > 0.3
    for generator in ("engine", "hf"):  # one profiled pass each: the shares cover all their self time
        profile = result["profile"][generator]
        assert profile["self_cpu_s"] > 0 and 0 < profile["matmul_share"] < 1
        shares = [op["share"] for op in profile["top_ops"]]
        assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert any(op["op"].endswith("_linear_pointwise") for op in result["profile"]["engine"]["top_ops"])
