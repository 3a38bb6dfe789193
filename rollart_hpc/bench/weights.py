"""`launch.py bench weights --json OUT [--sizes-mb 10,100,1000] [--receivers R] [--bucket-mb 64]`.

Starts its own MPI world (1 publisher + R receivers, `rollart_hpc.bench.weights_worker`) and measures,
per model size, the end-to-end weight publish (bucket assembly, wire, swap into a receiver-side dict of
parameters) against a raw broadcast of one flat buffer of the same bytes on the same group in the same
run. Per size it reports `ours_gb_s`, `raw_gb_s`, `ratio_vs_raw`, the receiver's pause (from the last
bucket landing to the new version in place) and the time the trainer is blocked in `publish`; the top
level repeats these per size (keyed by MB) with the worst ratio from 100 MB up (`headline`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rollart_hpc.contracts.errors import UsageError

MIN_HEADLINE_BYTES = 100_000_000
PUBLISH_MODES = ("stream", "deferred", "snapshot")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", required=True, help="write the results here (JSON)")
    parser.add_argument(
        "--sizes-mb", default="10,100,1000", help="model sizes in MB (10^6 bytes), comma-separated"
    )
    parser.add_argument("--receivers", type=int, default=2, help="number of receiving ranks")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size in MB")
    parser.add_argument(
        "--direct-mb",
        type=float,
        default=1.0,
        help="tensors of at least this many MB get a bucket of their own: sent from the tensor, received "
        "into the staged one, no copy on either side (0 = off: every tensor packed and copied)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per size (median reported)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="weight group backend")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="peer timeout inside the world")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--publish",
        choices=PUBLISH_MODES,
        default="stream",
        help="how the publisher is handed the weights: stream (publish_stream one tensor at a time, as the "
        "trainer publishes its units; returns once every tensor is packed or sent), deferred (publish with "
        "snapshot=False: return at once, pack in the background, tensors held until packed) or snapshot "
        "(publish packs a copy before it returns)",
    )
    mode.add_argument(
        "--stream", dest="publish", action="store_const", const="stream", help="the same as --publish stream"
    )
    mode.add_argument(
        "--deferred-pack",
        dest="publish",
        action="store_const",
        const="deferred",
        help="the same as --publish deferred",
    )


def parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--sizes-mb: expected comma-separated numbers, got {text!r}") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise UsageError(f"--sizes-mb: sizes must be positive, got {text!r}")
    return sizes


def worker_config(args: argparse.Namespace) -> dict[str, object]:
    if args.receivers < 1:
        raise UsageError(f"--receivers: must be >= 1, got {args.receivers}")
    if args.bucket_mb <= 0 or args.repeats < 1 or args.timeout_s <= 0:
        raise UsageError("--bucket-mb and --timeout-s must be > 0 and --repeats >= 1")
    if args.direct_mb < 0 or 0 < args.direct_mb * 1e6 < 64:
        raise UsageError(f"--direct-mb: must be 0 (off) or at least 64 bytes, got {args.direct_mb:g}")
    return {
        "sizes_bytes": [int(s * 1e6) for s in parse_sizes(args.sizes_mb)],
        "bucket_bytes": int(args.bucket_mb * 1e6),
        "direct_bytes": int(args.direct_mb * 1e6) or None,
        "repeats": args.repeats,
        "backend": args.backend,
        "timeout_s": args.timeout_s,
        "snapshot": args.publish == "snapshot",
        "stream": args.publish == "stream",
    }


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.cluster.mpiexec import mpi_session, mpiexec_argv
    from rollart_hpc.contracts.atomic import atomic_write_json

    config = worker_config(args)
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        config_path, out_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        config_path.write_text(json.dumps(config))
        world_size = args.receivers + 1
        worker = ("-m", "rollart_hpc.bench.weights_worker", str(config_path), str(out_path))
        cmd = mpiexec_argv(world_size, sys.executable, *worker)
        with mpi_session() as env:
            proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0 or not out_path.exists():
            print(f"error: benchmark world exited with code {proc.returncode}", file=sys.stderr)
            return 1
        result = json.loads(out_path.read_text())
    result["receivers"] = args.receivers
    result.update(headline(result["sizes"]))
    atomic_write_json(Path(args.json), result)
    print_table(result)
    return 0


def _size_key(nbytes: int) -> str:
    return f"{nbytes / 1e6:g}"


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Top-level figures: per size (key: MB) the ratio to the raw broadcast, the trainer's blocked time
    and its fraction of the transfer, the receiver's pause; the worst ratio over sizes of 100 MB and up
    (None when no size is that large) and the worst blocked fraction."""
    large = [row["ratio_vs_raw"] for row in rows if row["bytes"] >= MIN_HEADLINE_BYTES]
    return {
        "ratio_vs_raw": {_size_key(r["bytes"]): r["ratio_vs_raw"] for r in rows},
        "min_ratio_vs_raw_from_100mb": min(large) if large else None,
        "trainer_blocked_s": {_size_key(r["bytes"]): r["trainer_blocked_s"] for r in rows},
        "trainer_blocked_fraction": {_size_key(r["bytes"]): r["trainer_blocked_fraction"] for r in rows},
        "max_trainer_blocked_fraction": max(r["trainer_blocked_fraction"] for r in rows),
        "receiver_pause_s": {_size_key(r["bytes"]): r["receiver_pause_s"] for r in rows},
    }


def print_table(result: dict[str, object]) -> None:
    print(
        f"{'size MB':>9} {'ours GB/s':>10} {'raw GB/s':>9} {'ratio':>6} {'pause s':>8} {'blocked s':>10} {'blocked':>8}"
    )
    rows = result["sizes"]
    assert isinstance(rows, list)
    for row in rows:
        print(
            f"{row['bytes'] / 1e6:>9.1f} {row['ours_gb_s']:>10.3f} {row['raw_gb_s']:>9.3f} "
            f"{row['ratio_vs_raw']:>6.2f} {row['receiver_pause_s']:>8.4f} {row['trainer_blocked_s']:>10.4f} "
            f"{row['trainer_blocked_fraction']:>8.1%}"
        )
