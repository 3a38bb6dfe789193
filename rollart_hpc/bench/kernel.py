"""`bench kernel`: the fused LM-head log-prob + SPO++ loss (fwd+bwd) against an eager full-logits baseline.

On a GPU (default T=32768, H=4096, V=151936, bf16): fwd+bwd time (median of `--repeats` after `--warmup`),
achieved TFLOP/s counting 8*T*H*V (forward, recomputed logits, two backward GEMMs), peak memory above the
inputs, the same for the eager baseline, the card's measured bf16 matmul peak in the same run, and the
relative error of the fused result against the eager one. On CPU (small default sizes) it checks
correctness only: the Triton kernel runs under the interpreter, and `max_rel_err_fwd` /
`max_rel_err_grad` are measured against a float64 eager reference. Without a GPU and without
`TRITON_INTERPRET=1`, the command re-executes itself with the variable set (it must be set before triton
is imported). Relative error = max |x - ref| / max |ref| over each compared tensor.

`--trainer-loss` benchmarks the trainer's own entry point instead (`rollart_hpc.train.lm_head.token_logprobs`
then `rollart_hpc.algo.loss.policy_loss`, fwd+bwd, on CPU by default at T=2048, H=256, V=32768, fp32, a
quarter of the tokens masked as observations): loss_impl "fused" against "eager" (full logits and
Megatron's vocab-parallel cross-entropy), time per step and peak resident memory *measured* per step
(the kernel's peak-RSS counter VmHWM is reset through /proc/self/clear_refs before each step and read
after it; reported above the RSS at the reset), and the relative errors of fused against eager.

Inputs are built so that every token carries gradient (all action tokens, old log-probs within +-0.05 of
the current ones), so the fused backward cannot skip work that the FLOP count includes.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollart_hpc.bench.report import emit
from rollart_hpc.contracts.errors import UsageError

GPU_SHAPE = (32768, 4096, 151936)
CPU_SHAPE = (48, 32, 100)
TRAINER_SHAPE = (2048, 256, 32768)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--tokens", type=int, default=None, help="T (default 32768 on GPU, 48 on CPU)")
    parser.add_argument("--hidden", type=int, default=None, help="H (default 4096 on GPU, 32 on CPU)")
    parser.add_argument("--vocab", type=int, default=None, help="V (default 151936 on GPU, 100 on CPU)")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default=None, help="default bf16 GPU, fp32 CPU"
    )
    parser.add_argument("--impl", choices=("triton", "torch"), default="triton", help="fused implementation")
    parser.add_argument("--repeats", type=int, default=5, help="timed fwd+bwd runs (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (compilation)")
    parser.add_argument("--no-eager", action="store_true", help="skip the eager full-logits baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trainer-loss",
        action="store_true",
        help="the trainer's loss entry point, fused vs eager: time and measured peak memory per step",
    )


def _needs_interpreter(args: argparse.Namespace, cuda: bool) -> bool:
    return args.impl == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1"


def _reexec_with_interpreter() -> None:
    if "triton" in sys.modules:
        raise UsageError(
            "no GPU: rerun with TRITON_INTERPRET=1 set in the environment (triton is already imported)"
        )
    print("no GPU: re-running under TRITON_INTERPRET=1", file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "TRITON_INTERPRET": "1"})


def _resolve(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    if args.device == "cuda" and not cuda:
        raise UsageError("--device cuda: no CUDA device is visible")
    on_gpu = cuda and args.device != "cpu"
    shape = GPU_SHAPE if on_gpu else CPU_SHAPE
    sizes = [
        given if given is not None else default
        for given, default in zip((args.tokens, args.hidden, args.vocab), shape, strict=True)
    ]
    if min(sizes) < 1 or args.repeats < 1 or args.warmup < 0:
        raise UsageError("--tokens/--hidden/--vocab/--repeats must be >= 1 and --warmup >= 0")
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    return {
        "device": "cuda" if on_gpu else "cpu",
        "T": sizes[0],
        "H": sizes[1],
        "V": sizes[2],
        "dtype": dtype,
    }


def _make_inputs(spec: dict[str, Any], impl: str, seed: int) -> dict[str, Any]:
    import torch

    from rollart_hpc.kernels.policy_loss import linear_logprob

    gen = torch.Generator(device=spec["device"]).manual_seed(seed)
    dtype = getattr(torch, spec["dtype"])
    nt, nh, nv, dev = spec["T"], spec["H"], spec["V"], spec["device"]
    hidden = torch.randn(nt, nh, generator=gen, device=dev).to(dtype)
    weight = (torch.randn(nv, nh, generator=gen, device=dev) * nh**-0.5).to(dtype)
    targets = torch.randint(0, nv, (nt,), generator=gen, device=dev)
    with torch.no_grad():
        current = linear_logprob(hidden, weight, targets, impl=impl)
    old = current + 0.05 * torch.randn(nt, generator=gen, device=dev).clamp(-1, 1)
    return {
        "hidden": hidden,
        "weight": weight,
        "targets": targets,
        "action_mask": torch.ones(nt, dtype=torch.bool, device=dev),
        "old_logprobs": old,
        "behaviour_logprobs": old + 0.05 * torch.randn(nt, generator=gen, device=dev).clamp(-1, 1),
        "advantages": torch.randn(nt, generator=gen, device=dev),
    }


def _fused_step(data: dict[str, Any], impl: str) -> Callable[[], tuple[Any, ...]]:
    from rollart_hpc.kernels.common import KernelLossConfig
    from rollart_hpc.kernels.policy_loss import fused_policy_loss

    def step() -> tuple[Any, ...]:
        hidden = data["hidden"].detach().requires_grad_(True)
        weight = data["weight"].detach().requires_grad_(True)
        loss, logp, _ = fused_policy_loss(
            hidden,
            weight,
            data["targets"],
            data["action_mask"],
            data["old_logprobs"],
            data["behaviour_logprobs"],
            data["advantages"],
            data["targets"].numel(),
            KernelLossConfig(),
            impl=impl,
        )
        loss.backward()
        return loss.detach(), logp, hidden.grad, weight.grad

    return step


def _eager_step(data: dict[str, Any], dtype: Any = None) -> Callable[[], tuple[Any, ...]]:
    from rollart_hpc.kernels.common import KernelLossConfig, LossInputs
    from rollart_hpc.kernels.lm_head_reference import eager_policy_loss

    def step() -> tuple[Any, ...]:
        hidden = data["hidden"].detach().to(dtype or data["hidden"].dtype).requires_grad_(True)
        weight = data["weight"].detach().to(dtype or data["weight"].dtype).requires_grad_(True)
        inputs = LossInputs(
            data["action_mask"], data["old_logprobs"], data["behaviour_logprobs"], data["advantages"]
        )
        loss, logp = eager_policy_loss(
            hidden, weight, data["targets"], inputs, data["targets"].numel(), KernelLossConfig()
        )
        loss.backward()
        return loss.detach(), logp, hidden.grad, weight.grad

    return step


def _rel_err(got: Any, ref: Any) -> float:
    got, ref = got.double(), ref.double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _errors(fused: tuple[Any, ...], ref: tuple[Any, ...]) -> dict[str, float]:
    fwd = max(_rel_err(fused[0], ref[0]), _rel_err(fused[1], ref[1]))
    grad = max(_rel_err(fused[2], ref[2]), _rel_err(fused[3], ref[3]))
    return {"max_rel_err_fwd": fwd, "max_rel_err_grad": grad}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _measure(step: Callable[[], tuple[Any, ...]], device: str, warmup: int, repeats: int) -> dict[str, Any]:
    """Median wall time of `step` and, on CUDA, its peak memory above what was allocated before."""
    import torch

    for _ in range(warmup):
        step()
    _sync(device)
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    out: dict[str, Any] = {"time_ms": 1e3 * statistics.median(times), "times_ms": [1e3 * t for t in times]}
    if device == "cuda":
        out["peak_mem_gib_above_inputs"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _matmul_peak_tflops(n: int = 8192, repeats: int = 20) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def _with_tflops(entry: dict[str, Any], flops: float) -> dict[str, Any]:
    return {**entry, "tflops_8thv": flops / (entry["time_ms"] * 1e-3) / 1e12}


def _run_gpu(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    data = _make_inputs(spec, args.impl, args.seed)
    flops = 8.0 * spec["T"] * spec["H"] * spec["V"]
    fused_step = _fused_step(data, args.impl)
    result: dict[str, Any] = {
        "fused": _with_tflops(_measure(fused_step, "cuda", args.warmup, args.repeats), flops)
    }
    if not args.no_eager:
        try:
            result["eager"] = _with_tflops(
                _measure(_eager_step(data), "cuda", args.warmup, args.repeats), flops
            )
            result.update(_errors(fused_step(), _eager_step(data)()))
            result["errors_against"] = "eager, same dtype"
        except torch.cuda.OutOfMemoryError as exc:
            result["eager"] = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
    peak = _matmul_peak_tflops()
    result["matmul_peak_tflops_bf16"] = peak
    result["fused_fraction_of_matmul_peak"] = result["fused"]["tflops_8thv"] / peak
    result["gpu_name"] = torch.cuda.get_device_name()
    return result


def _run_cpu(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    data = _make_inputs(spec, args.impl, args.seed)
    fused_step = _fused_step(data, args.impl)
    result: dict[str, Any] = {"fused": _measure(fused_step, "cpu", args.warmup, args.repeats)}
    if not args.no_eager:
        result["eager"] = _measure(_eager_step(data), "cpu", args.warmup, args.repeats)
    result.update(_errors(fused_step(), _eager_step(data, torch.float64)()))
    result["errors_against"] = "eager float64"
    result["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"
    return result


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; return that RSS in KiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def _measure_rss(step: Callable[[], tuple[Any, ...]], warmup: int, repeats: int) -> dict[str, Any]:
    """Median wall time of `step` and the largest measured peak RSS of one step above its start."""
    import gc

    for _ in range(warmup):
        step()
    times, peaks = [], []
    for _ in range(repeats):
        gc.collect()
        base = _reset_peak_rss()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        peaks.append(_status_kib("VmHWM") - base)
    return {
        "time_ms": 1e3 * statistics.median(times),
        "times_ms": [1e3 * t for t in times],
        "peak_rss_mib_above_start": max(peaks) / 1024,
    }


def _trainer_inputs(spec: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    nt, nh, nv = spec["T"], spec["H"], spec["V"]
    mask = torch.ones(nt, dtype=torch.bool)
    mask[::4] = False  # observation tokens: weight 0 in the loss
    return {
        "hidden": torch.randn(nt, nh, generator=gen),
        "weight": torch.randn(nv, nh, generator=gen) * nh**-0.5,
        "targets": torch.randint(0, nv, (nt,), generator=gen),
        "batch": argparse.Namespace(
            action_mask=mask,
            behaviour_logprobs=torch.where(mask, -torch.rand(nt, generator=gen) * 12, 0.0),
            advantages=torch.where(mask, torch.randn(nt, generator=gen), 0.0),
        ),
    }


def _trainer_step(data: dict[str, Any], impl: str) -> Callable[[], tuple[Any, ...]]:
    from rollart_hpc.algo.loss import LossConfig, policy_loss
    from rollart_hpc.train.lm_head import LMHead, token_logprobs

    batch = data["batch"]
    denom = int(batch.action_mask.sum())

    def step() -> tuple[Any, ...]:
        hidden = data["hidden"].detach().requires_grad_(True)
        weight = data["weight"].detach().requires_grad_(True)
        lp = token_logprobs(impl, LMHead(weight.shape[0], 1, 600.0), hidden, weight, data["targets"])
        loss, _ = policy_loss(lp, batch, LossConfig(), denom)
        loss.backward()
        return loss.detach(), lp.detach(), hidden.grad, weight.grad

    return step


def _run_trainer_loss(args: argparse.Namespace) -> dict[str, Any]:
    """fused vs eager through the trainer's loss entry point on one CPU rank (a 1-rank gloo world)."""
    import torch.distributed as dist

    sizes = [
        g if g is not None else d
        for g, d in zip((args.tokens, args.hidden, args.vocab), TRAINER_SHAPE, strict=True)
    ]
    if min(sizes) < 1 or args.repeats < 1 or args.warmup < 0:
        raise UsageError("--tokens/--hidden/--vocab/--repeats must be >= 1 and --warmup >= 0")
    spec: dict[str, Any] = {"device": "cpu", "T": sizes[0], "H": sizes[1], "V": sizes[2], "dtype": "float32"}
    owned = not dist.is_initialized()  # a world this function makes, it also ends (callers may be tests)
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _trainer_loss_result(args, spec)
    finally:
        if owned:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def _trainer_loss_result(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rollart_hpc.train.model import ensure_model_parallel

    ensure_model_parallel(args.seed)
    torch.manual_seed(args.seed)
    data = _trainer_inputs(spec, args.seed)
    fused, eager = _trainer_step(data, "fused"), _trainer_step(data, "eager")
    result: dict[str, Any] = {**spec, "mode": "trainer_loss", "entry_point": "train.lm_head.token_logprobs"}
    result["fused"] = _measure_rss(fused, args.warmup, args.repeats)
    result["eager"] = _measure_rss(eager, args.warmup, args.repeats)
    result["eager_logits_mib"] = spec["T"] * spec["V"] * 4 / 2**20
    result["peak_ratio_eager_over_fused"] = result["eager"]["peak_rss_mib_above_start"] / max(
        result["fused"]["peak_rss_mib_above_start"], 1e-9
    )
    result.update(_errors(fused(), eager()))
    result["errors_against"] = "eager, float32"
    return result


def main(args: argparse.Namespace) -> int:
    import torch

    if getattr(args, "trainer_loss", False):
        result = _run_trainer_loss(args)
        result.update(torch=torch.__version__, python=platform.python_version(), host=platform.node())
        return emit(result, args)
    cuda = torch.cuda.is_available()
    spec = _resolve(args, cuda)
    if spec["device"] == "cpu" and _needs_interpreter(args, cuda):
        _reexec_with_interpreter()
    runner = _run_gpu if spec["device"] == "cuda" else _run_cpu
    result = {**spec, "impl": args.impl, "flop_count": "8*T*H*V", **runner(spec, args)}
    result.update(torch=torch.__version__, python=platform.python_version(), host=platform.node())
    return emit(result, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m rollart_hpc.bench.kernel", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
