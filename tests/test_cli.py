import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args, timeout=60):
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_unknown_override_key_is_one_line_exit_2():
    result = run_cli("run", "configs/smoke.toml", "trainer.nonexistent=1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "trainer.nonexistent" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_bad_value_names_allowed_set():
    result = run_cli("run", "configs/smoke.toml", "cluster.torch_backend=mpi")
    assert result.returncode == 2
    assert "'auto', 'gloo', 'nccl'" in result.stderr


def test_missing_config_file():
    result = run_cli("run", "configs/nope.toml")
    assert result.returncode == 2 and "config file not found" in result.stderr


def test_dry_run_prints_plan():
    result = run_cli("run", "configs/smoke.toml", "--dry-run", "roles.env.num_ranks=2")
    assert result.returncode == 0, result.stderr
    assert "world size 6" in result.stdout
    assert "env        ranks 2-3" in result.stdout
    assert "trainer    ranks 5" in result.stdout


def test_help_is_fast_and_torch_free():
    code = (
        "import sys; from rollart_hpc.entry.cli import build_parser; build_parser()\n"
        "assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
