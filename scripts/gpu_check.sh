#!/usr/bin/env bash
# The one prepared GPU check (one H100/H200-class GPU, under 8 minutes). Usage:
#   scripts/gpu_check.sh OUT_DIR [--dry]
# Runs, each under its own time limit, and writes under OUT_DIR:
#   1. kernel/bench_kernel.json: the fused LM-head log-prob + SPO++ loss kernel (compiled Triton) at T=32768,
#      H=4096, V=151936 bf16: fwd+bwd time, TFLOP/s against a bf16 matmul peak measured in the same run,
#      peak memory; the same for the eager torch path (full logits).
#   2. run3/: a 3-step `launch.py run` of the embedded default (configs/local.toml) with the trainer and a
#      vLLM rollout rank on the GPU (cluster.share_gpus: both on GPU 0); its summary.json shows the weights
#      published and loaded 3 times.
#   3. vllm/gpu_vllm_check.json: one weight publication into vLLM (WeightPublisher -> VLLMEngine) against a
#      raw broadcast of the same bytes (scripts/gpu_vllm_check.py).
# Then OUT_DIR/gpu_check.json and one summary table (scripts/gpu_check_summary.py); exit 1 if a part failed.
# --dry: check the arguments and print the commands, run nothing (what the CPU tests exercise).
# Python: GPU_PYTHON, else VLLM_PYTHON, else .venv-vllm/bin/python (vllm 0.32 CUDA build, torch, triton,
# mpi4py and this project, e.g. `VLLM_PACKAGE=vllm scripts/setup_vllm.sh`); MODEL_DIR as for gpu_vllm_check.
set -uo pipefail
usage() { echo "usage: scripts/gpu_check.sh OUT_DIR [--dry]" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
[ "${1:0:1}" != "-" ] || usage
OUT_ARG=$1
DRY=0
if [ $# = 2 ]; then [ "$2" = "--dry" ] || usage; DRY=1; fi
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-${VLLM_PYTHON:-.venv-vllm/bin/python}}
MPIEXEC="$(dirname "$PY")/mpiexec"
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || echo mpiexec)
mkdir -p "$OUT_ARG" && OUT=$(cd "$OUT_ARG" && pwd)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
export TOKENIZERS_PARALLELISM=false OMPI_MCA_btl=self,tcp
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
MODEL_ARGS=()
[ -n "${MODEL_DIR:-}" ] && MODEL_ARGS=(--model "$MODEL_DIR")

KERNEL=("$PY" launch.py bench kernel --device cuda --json "$OUT/kernel/bench_kernel.json" --repeats 5 --warmup 2)
RUN3=("$PY" launch.py run configs/local.toml rollout.engine=vllm roles.rollout.gpus_per_rank=1
  roles.trainer.gpus_per_rank=1 cluster.share_gpus=true controller.num_steps=3 controller.checkpoint_every_steps=0
  trainer.sft_steps=20 cluster.launch_timeout_s=200 --run-dir "$OUT/run3")
VLLM=("$MPIEXEC" -n 2 "$PY" scripts/gpu_vllm_check.py --out "$OUT/vllm" --gpus 1 "${MODEL_ARGS[@]}")
SUMMARY=("$PY" scripts/gpu_check_summary.py "$OUT")
# part name, time limit (s), command: 120 + 210 + 150 s at most, so the whole check stays under 8 minutes
STEPS=("kernel 120" "run3 210" "vllm 150")

if [ "$DRY" = 1 ]; then
  echo "gpu_check (dry) -> $OUT"
  echo "kernel (120 s): ${KERNEL[*]}"
  echo "run3 (210 s): ${RUN3[*]}"
  echo "vllm (150 s): ${VLLM[*]}"
  echo "summary: ${SUMMARY[*]}"
  exit 0
fi

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$OUT/nvidia_smi.csv" 2>&1 || true
start=$(date +%s)
for step in "${STEPS[@]}"; do
  read -r name limit <<<"$step"
  mkdir -p "$OUT/$name"
  case $name in
    kernel) cmd=("${KERNEL[@]}") ;;
    run3) rm -rf "$OUT/run3"; cmd=("${RUN3[@]}") ;;
    vllm) cmd=("${VLLM[@]}") ;;
  esac
  t0=$(date +%s)
  timeout "$limit" "${cmd[@]}" >"$OUT/$name.log" 2>&1
  echo "{\"part\": \"$name\", \"rc\": $?, \"wall_s\": $(( $(date +%s) - t0 )), \"limit_s\": $limit}" >"$OUT/$name.status.json"
  echo "[gpu_check] $name done: $(cat "$OUT/$name.status.json")"
done
echo "[gpu_check] all parts in $(( $(date +%s) - start )) s"
"${SUMMARY[@]}"
