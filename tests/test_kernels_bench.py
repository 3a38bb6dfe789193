"""Kernel selector, input validation, `bench kernel` on CPU, and the real-size GPU checks (marker gpu)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollart_hpc.kernels import KernelLossConfig, KernelTuning, fused_policy_loss, resolve_impl
from rollart_hpc.kernels.policy_loss import IMPL_ENV

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_selector_defaults_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IMPL_ENV, raising=False)
    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    assert resolve_impl("auto", torch.device("cuda")) == "triton"
    assert resolve_impl("torch", torch.device("cuda")) == "torch"
    monkeypatch.setenv(IMPL_ENV, "triton")
    assert resolve_impl("auto", torch.device("cpu")) == "triton"
    assert resolve_impl("torch", torch.device("cpu")) == "torch"  # an explicit argument wins over the env
    monkeypatch.setenv(IMPL_ENV, "cuda-magic")
    with pytest.raises(ValueError, match=IMPL_ENV):
        resolve_impl("auto", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown kernel impl"):
        resolve_impl("fast", torch.device("cpu"))


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_impl("triton", torch.device("cpu"))


def _args(nt: int = 8, nh: int = 16, nv: int = 20) -> tuple:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(nt, nh, generator=gen),
        torch.randn(nv, nh, generator=gen),
        torch.randint(0, nv, (nt,), generator=gen),
        torch.ones(nt, dtype=torch.bool),
        torch.zeros(nt),
        torch.zeros(nt),
        torch.randn(nt, generator=gen),
    )


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_bad_inputs_are_named(impl: str) -> None:
    h, w, t, m, old, beh, adv = _args()
    with pytest.raises(ValueError, match="num_global_action_tokens"):
        fused_policy_loss(h, w, t, m, old, beh, adv, 3, KernelLossConfig(), impl=impl)
    with pytest.raises(ValueError, match="hidden size differs"):
        fused_policy_loss(h, w[:, :8], t, m, old, beh, adv, 8, KernelLossConfig(), impl=impl)
    with pytest.raises(ValueError, match="targets must be"):
        fused_policy_loss(h, w, t[:5], m, old, beh, adv, 8, KernelLossConfig(), impl=impl)
    with pytest.raises(ValueError, match="advantages must be"):
        fused_policy_loss(h, w, t, m, old, beh, adv[:5], 8, KernelLossConfig(), impl=impl)
    with pytest.raises(ValueError, match="power of 2"):
        KernelTuning(block_v=48)


def test_triton_rejects_float64() -> None:
    h, w, t, m, old, beh, adv = _args()
    with pytest.raises(ValueError, match="float64"):
        fused_policy_loss(h.double(), w.double(), t, m, old, beh, adv, 8, KernelLossConfig(), impl="triton")


def _package_imports(tree: ast.AST) -> list[str]:
    """Absolute `rollart_hpc...` modules imported anywhere in a module (function-level imports too)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "rollart_hpc/kernels/ uses absolute imports (rollart_hpc.kernels.x)"
            found += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(arg.value)
    return [name for name in found if name == "rollart_hpc" or name.startswith("rollart_hpc.")]


def test_kernels_import_nothing_of_the_package_but_themselves(repo_root: Path) -> None:
    files = sorted((repo_root / "rollart_hpc" / "kernels").rglob("*.py"))
    assert len(files) >= 5
    imports = {f.name: _package_imports(ast.parse(f.read_text(), str(f))) for f in files}
    outside = {
        name: [m for m in mods if not m.startswith("rollart_hpc.kernels.")] for name, mods in imports.items()
    }
    assert not any(outside.values()), outside
    assert any(imports.values())  # the scan sees the kernels' own imports, so it could see others


def test_bench_module_imports_nothing_heavy(python: str) -> None:
    code = "import sys, rollart_hpc.bench.kernel; print(sorted({'torch', 'triton'} & set(sys.modules)))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bench_cpu_reports_errors(tmp_path: Path) -> None:
    from rollart_hpc.bench import kernel

    parser = argparse.ArgumentParser()
    kernel.add_arguments(parser)
    out = tmp_path / "k.json"
    args = parser.parse_args(
        ["--json", str(out), "--tokens", "40", "--vocab", "90", "--repeats", "1", "--warmup", "0"]
    )
    assert kernel.main(args) == 0
    result = json.loads(out.read_text())
    assert (result["device"], result["T"], result["V"], result["impl"]) == ("cpu", 40, 90, "triton")
    assert result["triton_interpret"] is True
    assert 0 < result["max_rel_err_fwd"] <= 1e-4 and 0 < result["max_rel_err_grad"] <= 1e-4
    assert result["fused"]["time_ms"] > 0 and result["eager"]["time_ms"] > 0


@pytest.mark.slow  # two fresh interpreters importing torch and triton: ~20 s here
def test_bench_cpu_reexecs_under_the_interpreter(tmp_path: Path, python: str, repo_root: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = tmp_path / "k.json"
    cmd = [
        python,
        "-m",
        "rollart_hpc.bench.kernel",
        "--json",
        str(out),
        "--tokens",
        "16",
        "--hidden",
        "16",
        "--vocab",
        "33",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--no-eager",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo_root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "re-running under TRITON_INTERPRET=1" in proc.stderr
    assert json.loads(out.read_text())["max_rel_err_grad"] <= 1e-4


@pytest.mark.gpu
@needs_cuda
def test_gpu_real_vocab_parity_and_memory() -> None:
    """bf16, nt=4096, nh=4096, nv=151936 on the GPU: Triton equals the torch reference, memory stays O(chunk)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("run with TRITON_INTERPRET=0 (scripts/kernel_gpu_check.sh does)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    nt, nh, nv = 4096, 4096, 151936
    hidden = torch.randn(nt, nh, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(nv, nh, device="cuda", generator=gen) * nh**-0.5).bfloat16()
    targets = torch.randint(0, nv, (nt,), device="cuda", generator=gen)
    mask = torch.ones(nt, dtype=torch.bool, device="cuda")
    adv = torch.randn(nt, device="cuda", generator=gen)
    results = {}
    for impl in ("triton", "torch"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        old = torch.full((nt,), -12.0, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, logp, _ = fused_policy_loss(
            h, w, targets, mask, old, old, adv, nt, KernelLossConfig(), impl=impl
        )
        loss.backward()
        results[impl] = (loss.detach(), logp, h.grad, w.grad, torch.cuda.max_memory_allocated() - base)
    for got, ref in zip(results["triton"][:4], results["torch"][:4], strict=True):
        err = (got.double() - ref.double()).abs().max() / ref.double().abs().max()
        assert float(err) <= 2e-2
    assert results["triton"][4] < 4 * 2**30  # full fp32 logits alone would be 2.3 GiB; grads take 1.2 GiB


@pytest.mark.gpu
@needs_cuda
def test_gpu_bench_real_size(tmp_path: Path) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("run with TRITON_INTERPRET=0 (scripts/kernel_gpu_check.sh does)")
    from rollart_hpc.bench import kernel

    parser = argparse.ArgumentParser()
    kernel.add_arguments(parser)
    out = tmp_path / "k.json"
    assert kernel.main(parser.parse_args(["--json", str(out), "--repeats", "3", "--warmup", "1"])) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cuda" and result["max_rel_err_grad"] <= 2e-2
    assert result["fused"]["peak_mem_gib_above_inputs"] < result["eager"].get(
        "peak_mem_gib_above_inputs", 1e9
    )
    print(json.dumps(result), file=sys.stderr)
