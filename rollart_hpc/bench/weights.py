"""`launch.py bench weights --json OUT [--sizes-mb 10,100,1000] [--receivers R] [--bucket-mb 64]`.

Starts its own MPI world (1 publisher + R receivers, `rollart_hpc.bench.weights_worker`) and measures,
per model size, the end-to-end weight publish (bucket assembly, wire, swap into a receiver-side dict of
parameters) against a raw broadcast of one flat buffer of the same bytes on the same group in the same
run. Reports `ours_gb_s`, `raw_gb_s`, `ratio_vs_raw` and the receiver's pause (time to swap).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rollart_hpc.contracts.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", required=True, help="write the results here (JSON)")
    parser.add_argument(
        "--sizes-mb", default="10,100,1000", help="model sizes in MB (10^6 bytes), comma-separated"
    )
    parser.add_argument("--receivers", type=int, default=2, help="number of receiving ranks")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size in MB")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions per size (median reported)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="weight group backend")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="peer timeout inside the world")


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
    return {
        "sizes_bytes": [int(s * 1e6) for s in parse_sizes(args.sizes_mb)],
        "bucket_bytes": int(args.bucket_mb * 1e6),
        "repeats": args.repeats,
        "backend": args.backend,
        "timeout_s": args.timeout_s,
    }


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.contracts.atomic import atomic_write_json
    from rollart_hpc.entry.launcher import mpi_environment

    config = worker_config(args)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        config_path, out_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        config_path.write_text(json.dumps(config))
        world_size = args.receivers + 1
        cmd = [str(mpiexec), "-n", str(world_size), "--oversubscribe", sys.executable, "-m",
               "rollart_hpc.bench.weights_worker", str(config_path), str(out_path)]  # fmt: skip
        proc = subprocess.run(cmd, env=mpi_environment())
        if proc.returncode != 0 or not out_path.exists():
            print(f"error: benchmark world exited with code {proc.returncode}", file=sys.stderr)
            return 1
        result = json.loads(out_path.read_text())
    result["receivers"] = args.receivers
    atomic_write_json(Path(args.json), result)
    print_table(result)
    return 0


def print_table(result: dict[str, object]) -> None:
    print(f"{'size MB':>9} {'ours GB/s':>10} {'raw GB/s':>9} {'ratio':>6} {'pause s':>8} {'publish s':>10}")
    rows = result["sizes"]
    assert isinstance(rows, list)
    for row in rows:
        print(
            f"{row['bytes'] / 1e6:>9.1f} {row['ours_gb_s']:>10.3f} {row['raw_gb_s']:>9.3f} "
            f"{row['ratio_vs_raw']:>6.2f} {row['receiver_pause_s']:>8.4f} {row['publish_return_s']:>10.4f}"
        )
