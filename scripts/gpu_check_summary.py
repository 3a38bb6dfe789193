"""Summary of scripts/gpu_check.sh: reads what its four parts wrote under OUT_DIR, writes
OUT_DIR/gpu_check.json and prints one table. Exit 1 when a part that ran failed or its result is missing; a
part the script skipped (its status says why, e.g. vLLM not installed) is listed as skipped and fails nothing.

Parts and the files read: kernel (kernel/bench_kernel.json from `launch.py bench kernel`, and the kernel
tests' pytest_kernel.txt), trainer (trainer/pytest_trainer.txt: the trainer tests on CUDA; trainer/
train_memory.json from scripts/gpu_train_memory.py), run3 (the run dir's summary.json: versions loaded by each
rollout rank), vllm (vllm/gpu_vllm_check.json: one weight publication into vLLM against a raw broadcast of the
same bytes), and each part's `<part>.status.json`. Stdlib only, so it runs (and is tested) anywhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PARTS = ("kernel", "trainer", "run3", "vllm")
STEPS_OF_RUN3 = 3


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def kernel_rows(bench: dict[str, Any] | None) -> tuple[list[tuple[str, str]], bool]:
    if bench is None or "fused" not in bench:
        return [("kernel", "no result (kernel/bench_kernel.json)")], False
    peak = bench.get("matmul_peak_tflops_bf16")
    rows = [("bf16 matmul peak", f"{peak:.0f} TFLOP/s" if peak else "not measured")]
    for name in ("fused", "eager"):
        entry = bench.get(name)
        if not entry:
            rows.append((f"{name} fwd+bwd", "not run"))
            continue
        share = f" ({entry['tflops_8thv'] / peak:.0%} of peak)" if peak else ""
        rows.append(
            (
                f"{name} fwd+bwd T=32768 H=4096 V=151936",
                f"{entry['time_ms']:.1f} ms, {entry['tflops_8thv']:.0f} TFLOP/s{share}, "
                f"peak {entry.get('peak_mem_gib', float('nan')):.1f} GiB",
            )
        )
    return rows, True


def _pytest_line(path: Path) -> str:
    """The closing line of a pytest log ('3 passed, 1 skipped in 9.1s'), or why there is none."""
    try:
        lines = [line.strip(" =") for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return "no log"
    closing = [
        line for line in lines if " in " in line and ("passed" in line or "failed" in line or "error" in line)
    ]
    return closing[-1] if closing else "no closing line"


def trainer_rows(memory: dict[str, Any] | None, log_line: str) -> tuple[list[tuple[str, str]], bool]:
    rows = [("trainer tests on CUDA", log_line)]
    ok = "passed" in log_line and "failed" not in log_line and "error" not in log_line
    if memory is None or "cells" not in memory:
        return [*rows, ("trainer memory and step time", "no result (trainer/train_memory.json)")], False
    for cell in memory["cells"]:
        name = f"train step {cell['attention']}/{cell['recompute']} {cell['rows']}x{cell['tokens']}"
        if cell.get("oom"):
            rows.append((name, "out of memory"))
        else:
            rows.append((name, f"{cell['step_s'] * 1e3:.0f} ms, peak {cell['peak_mib'] / 1024:.1f} GiB"))
    return rows, ok


def run_rows(summary: dict[str, Any] | None) -> tuple[list[tuple[str, str]], bool]:
    if summary is None:
        return [("3-step run (vLLM rollout + trainer)", "no summary.json")], False
    versions = {rank: list(v) for rank, v in summary.get("rollout_versions", {}).items()}
    loaded = min((max(v) for v in versions.values() if v), default=0)
    ok = bool(versions) and loaded >= STEPS_OF_RUN3
    text = f"{summary.get('wall_s', float('nan')):.0f} s, rollout versions loaded {versions}"
    return [("3-step run (vLLM rollout + trainer)", f"{text} -> {'ok' if ok else 'FEWER THAN 3 LOADS'}")], ok


def vllm_rows(check: dict[str, Any] | None) -> tuple[list[tuple[str, str]], bool]:
    if check is None or "update_vs_raw" not in check:
        return [("weight publication into vLLM", "no result (vllm/gpu_vllm_check.json)")], False
    raw, update = check["update_vs_raw"], check.get("update", {})
    gib = check.get("bytes", 0) / 2**30
    return [
        (
            "weight publication into vLLM",
            f"{gib:.2f} GiB: total {update.get('total_s', float('nan')):.3f} s, raw copy "
            f"{raw['raw_median_s']:.3f} s ({raw['raw_GBps']:.1f} GB/s), total/raw {raw['total_over_raw']:.2f}x",
        )
    ], True


def summarize(out: Path) -> tuple[dict[str, Any], str, bool]:
    """(the merged JSON, the table, whether every part passed)."""
    status = {part: _load(out / f"{part}.status.json") for part in PARTS}
    results = {
        "kernel": _load(out / "kernel" / "bench_kernel.json"),
        "trainer": _load(out / "trainer" / "train_memory.json"),
        "run3": _load(out / "run3" / "summary.json"),
        "vllm": _load(out / "vllm" / "gpu_vllm_check.json"),
    }
    makers: dict[str, Any] = {
        "kernel": kernel_rows,
        "trainer": lambda memory: trainer_rows(memory, _pytest_line(out / "trainer" / "pytest_trainer.txt")),
        "run3": run_rows,
        "vllm": vllm_rows,
    }
    rows: list[tuple[str, str]] = []
    ok = True
    for part in PARTS:
        st = status[part]
        if st is not None and st.get("skipped"):
            rows.append((part, f"skipped: {st['skipped']}"))
            continue
        part_rows, part_ok = makers[part](results[part])
        part_ok = part_ok and st is not None and st.get("rc") == 0
        when = f" [{st['wall_s']} s of {st['limit_s']} s, rc {st['rc']}]" if st else " [not run]"
        rows += [(name, value + (when if i == 0 else "")) for i, (name, value) in enumerate(part_rows)]
        ok = ok and part_ok
    width = max(len(name) for name, _ in rows)
    table = "\n".join(
        [f"{'check':<{width}}  result", f"{'-' * width}  ------"] + [f"{n:<{width}}  {v}" for n, v in rows]
    )
    return {"ok": ok, "status": status, **results}, table, ok


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: gpu_check_summary.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    merged, table, ok = summarize(out)
    (out / "gpu_check.json").write_text(json.dumps(merged, indent=2) + "\n")
    print(table)
    print(f"gpu_check {'passed' if ok else 'FAILED'}: {out / 'gpu_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
