"""`bench activations`: the trainer model's forward+backward under each core attention x recomputation.

Cells: attention {sdpa, unfused} x recompute {none, selective, full} (`trainer.attention`,
`trainer.recompute`) x micro-batch shapes rows x tokens. Each cell builds a GPTModel through the trainer's
own path (`train.model.build_gpt`, one rank, from an in-memory Qwen2-style `ModelConfig`: RMSNorm, SwiGLU,
RoPE, GQA, qkv bias), fills it with seeded random weights (the same in every cell), and runs steps of
forward, the trainer's fused LM-head log-probs of random next tokens (`lm_head.head_logprobs`: never the
[tokens, vocab] logits, so the head costs the same in every cell), loss = their negative mean, backward.
Parameter gradients are allocated before the first step, so no cell counts them as activations.

Memory is measured, not modelled:
- CUDA (all cells in this process): `torch.cuda.max_memory_allocated` over the timed steps, its peak
  statistics reset after the warm-up steps; reported as the peak and as the peak above the memory
  allocated at the reset (weights, gradients, inputs). Megatron's global buffer of the unfused attention
  is dropped between cells.
- CPU: every cell runs in a fresh Python process (`python -m rollart_hpc.bench.activations CELL`). The
  kernel's peak-RSS counter (VmHWM) is reset to the current RSS just before the first step, and the peak
  of that step above the reset is reported. The first step of a fresh process takes all of its memory
  from the OS; later steps reuse blocks the allocator kept, which is why a cell gets a process of its
  own and why its first step is the measured one.
Time: median seconds per step over `--repeats` steps after the warm-up (CUDA events on a GPU, wall clock
on CPU, where the measured first step counts as a warm-up step). A cell that runs out of GPU memory is
recorded as "oom" and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rollart_hpc.config.learning import ATTENTION_IMPLS as ATTENTIONS
from rollart_hpc.config.learning import PRECISIONS
from rollart_hpc.config.learning import RECOMPUTE_MODES as RECOMPUTES
from rollart_hpc.contracts.errors import UsageError

CPU_SHAPE = {"hidden": 512, "layers": 4, "heads": 8, "kv_heads": 2, "ffn": 1408, "vocab": 8192}


def add_arguments(
    parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None, json_flag: str = "--json"
) -> None:
    """The model shape, cells and repetitions; `defaults` overrides the shape defaults and `json_flag`
    names the output option (a GPU script)."""
    shape = {**CPU_SHAPE, "micro_batches": "1x2048,1x4096", "repeats": 2, **(defaults or {})}
    parser.add_argument(json_flag, dest="json", type=Path, default=None, help="write the JSON result here")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--hidden", type=int, default=shape["hidden"])
    parser.add_argument("--layers", type=int, default=shape["layers"])
    parser.add_argument("--heads", type=int, default=shape["heads"])
    parser.add_argument("--kv-heads", type=int, default=shape["kv_heads"])
    parser.add_argument("--ffn", type=int, default=shape["ffn"])
    parser.add_argument("--vocab", type=int, default=shape["vocab"])
    parser.add_argument(
        "--micro-batches", default=shape["micro_batches"], help="comma-separated ROWSxTOKENS shapes"
    )
    parser.add_argument("--tokens", type=int, default=None, help="one micro-batch of 1 x TOKENS instead")
    parser.add_argument("--attention", default=",".join(ATTENTIONS), help="comma-separated subset")
    parser.add_argument("--recompute", default=",".join(RECOMPUTES), help="comma-separated subset")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument(
        "--repeats", type=int, default=shape["repeats"], help="timed steps per cell (median reported)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (CUDA)")
    parser.add_argument("--seed", type=int, default=0)


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise UsageError(f"{flag}: choose from {','.join(allowed)}, got {text!r}")
    return items


def _micro_batches(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.tokens is not None:
        return [(1, args.tokens)]
    try:
        shapes = [tuple(int(x) for x in part.lower().split("x")) for part in args.micro_batches.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise UsageError(f"--micro-batches: ROWSxTOKENS[,ROWSxTOKENS...], got {args.micro_batches!r}")
    return [(s[0], s[1]) for s in shapes]


def resolve(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """The run's spec: device, model shape, cells; UsageError on a bad value."""
    if args.device == "cuda" and not cuda:
        raise UsageError("--device cuda: no CUDA device is visible")
    sizes = (args.hidden, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab)
    if min(sizes) < 1 or args.repeats < 1 or args.warmup < 0:
        raise UsageError("model sizes and --repeats must be >= 1, --warmup >= 0")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise UsageError("--heads must divide --hidden and --kv-heads must divide --heads")
    shapes = _micro_batches(args)
    return {
        "device": "cuda" if cuda and args.device != "cpu" else "cpu",
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "ffn": args.ffn,
            "vocab": args.vocab,
            "max_tokens": max(t for _, t in shapes),
        },
        "precision": args.precision,
        "micro_batches": shapes,
        "attention": _choices(args.attention, ATTENTIONS, "--attention"),
        "recompute": _choices(args.recompute, RECOMPUTES, "--recompute"),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "seed": args.seed,
    }


def model_config(shape: dict[str, int]) -> Any:
    """A Qwen2-style `ModelConfig` of the given shape (tied embeddings, qkv bias, rope theta 1e6)."""
    from rollart_hpc.models.config import ModelConfig

    return ModelConfig(
        model_type="qwen2",
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_layers=shape["layers"],
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        head_dim=shape["hidden"] // shape["heads"],
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=max(shape["max_tokens"], 32),
        tie_word_embeddings=True,
        qkv_bias=True,
    )


def init_single_rank(device: str, seed: int) -> None:
    """One-rank torch.distributed (no port) and Megatron's parallel state, as the tests set them up."""
    import torch.distributed as dist

    from rollart_hpc.train.model import ensure_model_parallel

    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    ensure_model_parallel(seed)


def _build(spec: dict[str, Any], attention: str, recompute: str) -> Any:
    """The cell's model: seeded random weights (norm weights 1) in the trainer's parameter dtype of
    --precision (`build_gpt`: bf16 parameters and Megatron's bf16 config, or fp32), gradients allocated in
    that dtype (no optimizer here, so no fp32 main gradients), returning final hidden states."""
    import torch

    from rollart_hpc.train.model import build_gpt

    device = torch.device(spec["device"])
    model = build_gpt(
        model_config(spec["model"]),
        device,
        precision=spec["precision"],
        attention=attention,
        recompute=recompute,
    )
    gen = torch.Generator(device=device).manual_seed(spec["seed"])
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    model.return_hidden = True
    return model.train()


def _inputs(spec: dict[str, Any], rows: int, tokens: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    ids = torch.randint(0, spec["model"]["vocab"], (rows, tokens + 1), generator=gen)
    return ids[:, :-1].to(spec["device"]), ids[:, 1:].reshape(-1).to(spec["device"])


def _step(model: Any, ids: Any, targets: Any, vocab: int) -> float:
    """Forward, fused LM-head log-probs, mean NLL, backward; the loss."""
    from rollart_hpc.train.lm_head import LMHead, head_logprobs

    hidden = model(ids, None, None)  # [s, b, H]
    flat = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
    logp = head_logprobs(LMHead(vocab, 1, 600.0), flat, model.shared_embedding_or_output_weight(), targets)
    loss = -logp.mean()
    loss.backward()
    return float(loss.detach())


def _cuda_cell(spec: dict[str, Any], model: Any, rows: int, tokens: int) -> dict[str, Any]:
    import torch

    ids, targets = _inputs(spec, rows, tokens)
    vocab = spec["model"]["vocab"]
    for _ in range(spec["warmup"]):
        _step(model, ids, targets, vocab)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated()
    times, loss = [], 0.0
    for _ in range(spec["repeats"]):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        loss = _step(model, ids, targets, vocab)
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    peak = torch.cuda.max_memory_allocated()
    return {
        "peak_mib": peak / 2**20,
        "peak_mib_above_start": (peak - start_bytes) / 2**20,
        "step_s": statistics.median(times),
        "steps_s": times,
        "loss": loss,
    }


def _cpu_cell(spec: dict[str, Any], model: Any, rows: int, tokens: int) -> dict[str, Any]:
    from rollart_hpc.bench.kernel import _reset_peak_rss, _status_kib

    ids, targets = _inputs(spec, rows, tokens)
    vocab = spec["model"]["vocab"]
    gc.collect()
    base = _reset_peak_rss()
    begin = time.perf_counter()
    loss = _step(model, ids, targets, vocab)
    first = time.perf_counter() - begin
    peak = _status_kib("VmHWM") - base
    times = []
    for _ in range(spec["repeats"]):
        begin = time.perf_counter()
        loss = _step(model, ids, targets, vocab)
        times.append(time.perf_counter() - begin)
    return {
        "peak_rss_mib_above_start": peak / 1024,
        "rss_mib_at_start": base / 1024,
        "first_step_s": first,
        "step_s": statistics.median(times),
        "steps_s": times,
        "loss": loss,
    }


def run_cell(spec: dict[str, Any], attention: str, recompute: str, rows: int, tokens: int) -> dict[str, Any]:
    """One cell in this process (see the module docstring for what is measured on each device)."""
    import torch

    cell: dict[str, Any] = {"attention": attention, "recompute": recompute, "rows": rows, "tokens": tokens}
    init_single_rank(spec["device"], spec["seed"])
    model = None
    try:
        model = _build(spec, attention, recompute)
        measure = _cuda_cell if spec["device"] == "cuda" else _cpu_cell
        cell.update(measure(spec, model, rows, tokens))
    except torch.cuda.OutOfMemoryError as exc:
        cell.update(oom=True, error=str(exc).splitlines()[0])
    finally:
        del model
        _release(spec["device"])
    return cell


def _release(device: str) -> None:
    """Free the previous cell's memory, Megatron's global attention buffer included."""
    import torch
    from megatron.core import parallel_state

    gc.collect()
    parallel_state.destroy_global_memory_buffer()
    parallel_state._set_global_memory_buffer()
    if device == "cuda":
        torch.cuda.empty_cache()


def _cell_in_subprocess(
    spec: dict[str, Any], attention: str, recompute: str, rows: int, tokens: int
) -> dict[str, Any]:
    """`run_cell` in a fresh Python process (CPU memory; see the module docstring)."""
    request = json.dumps({"spec": spec, "cell": [attention, recompute, rows, tokens]})
    proc = subprocess.run(
        [sys.executable, "-m", "rollart_hpc.bench.activations", request],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],  # the package's root, on the child's sys.path
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"cell {attention}/{recompute} {rows}x{tokens} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Every cell of `spec`; CUDA cells in this process, CPU cells in a process each."""
    import torch

    cells = []
    for rows, tokens in spec["micro_batches"]:
        for attention in spec["attention"]:
            for recompute in spec["recompute"]:
                one = run_cell if spec["device"] == "cuda" else _cell_in_subprocess
                cells.append(one(spec, attention, recompute, rows, tokens))
                print(_row(cells[-1]), file=sys.stderr, flush=True)
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    if spec["device"] == "cuda":
        from rollart_hpc.train import attention

        info["gpu"] = torch.cuda.get_device_name()
        info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        info["flash_attn"] = attention.flash_attn_varlen_func is not None
    else:
        info["cpu_count"] = os.cpu_count()
        info["load_average"] = os.getloadavg()
    return {"spec": spec, "machine": info, "cells": cells}


def _row(cell: dict[str, Any]) -> str:
    shape = f"{cell['rows']}x{cell['tokens']}"
    head = f"{shape:>8} {cell['attention']:>8} {cell['recompute']:>9}"
    if cell.get("oom"):
        return f"{head} {'OOM':>12}"
    if "peak_mib" in cell:
        return f"{head} {cell['peak_mib']:12.0f} {cell['peak_mib_above_start']:12.0f} {cell['step_s']:9.3f}"
    return f"{head} {cell['peak_rss_mib_above_start']:12.0f} {cell['step_s']:9.3f}"


def table(result: dict[str, Any]) -> str:
    """The cells as a text table (peak MiB, peak above the start MiB on CUDA, seconds per step)."""
    cuda = result["spec"]["device"] == "cuda"
    cols = "peak MiB  above start    s/step" if cuda else "peak RSS MiB above start    s/step"
    lines = [f"{'micro':>8} {'attn':>8} {'recompute':>9}  {cols}"]
    return "\n".join(lines + [_row(c) for c in result["cells"]])


def main(args: argparse.Namespace) -> int:
    import torch

    spec = resolve(args, torch.cuda.is_available())
    result = run(spec)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    print(table(result))
    return 0


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps(run_cell(request["spec"], *request["cell"])))
