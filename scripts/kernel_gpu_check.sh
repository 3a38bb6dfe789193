#!/usr/bin/env bash
# Real-size checks of the fused LM-head log-prob + SPO++ loss on one H100/H200 (compiled Triton, no interpreter).
# Usage: scripts/kernel_gpu_check.sh [OUT_DIR]   (default ./kernel_gpu_check); run from anywhere inside the repo.
# Writes OUT_DIR/bench_kernel.json (T=32768, H=4096, V=151936, bf16: fused vs eager, bf16 matmul peak)
# and OUT_DIR/pytest_gpu.txt (the gpu-marked parity/memory tests). Exits non-zero if either fails.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "${1:-kernel_gpu_check}" && cd "${1:-kernel_gpu_check}" && pwd)"
cd "$repo"
export TRITON_INTERPRET=0
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/nvidia_smi.csv"
python launch.py bench kernel --json "$out/bench_kernel.json" --repeats 5 --warmup 2
python -m pytest tests/test_kernels_policy_loss.py tests/test_kernels_bench.py -m gpu -q -rs 2>&1 | tee "$out/pytest_gpu.txt"
echo "results in $out"
