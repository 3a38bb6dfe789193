#!/usr/bin/env bash
# The one prepared GPU check (one H100/H200-class GPU, at most 10 minutes). Usage:
#   scripts/gpu_check.sh OUT_DIR [--dry]
# Runs, each under its own time limit, and writes under OUT_DIR:
#   1. kernel/: the fused LM-head log-prob + SPO++ loss kernel (compiled Triton) at T=32768, H=4096,
#      V=151936 bf16 against the eager torch path (bench_kernel.json: time, TFLOP/s against a bf16 matmul peak
#      measured in the same run, peak memory) and the gpu-marked kernel tests (pytest_kernel.txt), among them the
#      trainer head's kernel path on a padded vocabulary shard (tests/test_train_lm_head.py).
#   2. trainer/: the trainer on CUDA (one rank, NCCL): the trainer, conversion, precision and attention tests
#      (pytest_trainer.txt; they build their inputs on the trainer's device and take float32 tolerances that
#      widen under TF32 from tests/train_device.py), and scripts/gpu_train_memory.py (train_memory.json: peak
#      memory and step time of a Qwen2.5-1.5B-shaped model per attention and recomputation setting, bf16).
#   3. run3/: a 3-step `launch.py run` of the embedded default (configs/local.toml, household games prepared
#      first) with the trainer and a vLLM rollout rank on GPU 0 (cluster.share_gpus, vLLM at 45% of the
#      GPU), no evaluation rounds; its summary.json shows the weights published and loaded 3 times.
#   4. vllm/: one weight publication into vLLM (WeightPublisher -> VLLMEngine) against a raw broadcast of the
#      same bytes (scripts/gpu_vllm_check.py).
# Parts 3 and 4 need vLLM (a CUDA build of vllm 0.32 in the Python used): where `import vllm` fails they are
# recorded as skipped with that reason, not run. What one GPU cannot check: NCCL does not put two ranks of one
# communicator on one GPU, so tensor/pipeline/data-parallel trainer layouts and NCCL weight broadcast between
# ranks need two GPUs or more (tests/test_train_layouts_mpi.py and tests/test_weights_mpi.py with CUDA), and so
# does the LM-head kernel's tensor-parallel parity (tests/test_train_lm_head_mpi.py: TP 2, shards combined over
# the group; CPU gloo here). Also GPU-only: the weight publisher's send ring in device memory under NCCL
# (a ring buffer reused once `work.wait()` has ordered the stream after its broadcast; lone buckets sent
# straight from the unit's CUDA tensor), whose bound `torch.cuda.max_memory_allocated` would confirm in
# part 4 (WeightPublisher.peak_bytes <= 2 x bucket there); and sliced safetensors reads straight to the
# device are not used (a rank's shard is read to host memory, then copied to its GPU).
# Then OUT_DIR/gpu_check.json and one summary table (scripts/gpu_check_summary.py); exit 1 if a part that ran
# failed.
# --dry: check the arguments and print the commands, run nothing (what the CPU tests exercise).
# Python: GPU_PYTHON, else VLLM_PYTHON, else .venv-vllm/bin/python, else python3 (torch with CUDA, triton,
# megatron-core, mpi4py and this project's dependencies; vllm for parts 3 and 4); MODEL_DIR as for
# gpu_vllm_check.
set -uo pipefail
usage() { echo "usage: scripts/gpu_check.sh OUT_DIR [--dry]" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
[ "${1:0:1}" != "-" ] || usage
OUT_ARG=$1
DRY=0
if [ $# = 2 ]; then [ "$2" = "--dry" ] || usage; DRY=1; fi
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-${VLLM_PYTHON:-.venv-vllm/bin/python}}
[ -x "$PY" ] || command -v "$PY" >/dev/null || PY=python3
MPIEXEC="$(dirname "$(command -v "$PY" || echo "$PY")")/mpiexec"
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || echo mpiexec)
mkdir -p "$OUT_ARG" && OUT=$(cd "$OUT_ARG" && pwd)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
export TOKENIZERS_PARALLELISM=false OMPI_MCA_btl=self,tcp
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
MODEL_ARGS=()
[ -n "${MODEL_DIR:-}" ] && MODEL_ARGS=(--model "$MODEL_DIR")
TRAIN_TESTS=(tests/test_train_trainer.py tests/test_train_convert.py)
for extra in tests/test_train_precision.py tests/test_train_attention.py tests/test_train_recompute.py; do
  [ -f "$extra" ] && TRAIN_TESTS+=("$extra")
done

KERNEL=(bash -c "\"\$0\" launch.py bench kernel --device cuda --json \"\$1/kernel/bench_kernel.json\" --repeats 5 \
--warmup 2 && \"\$0\" -m pytest -p no:cacheprovider -q -rs -m gpu tests/test_kernels_policy_loss.py \
tests/test_kernels_bench.py tests/test_train_lm_head.py >\"\$1/kernel/pytest_kernel.txt\" 2>&1" "$PY" "$OUT")
TRAINER=(bash -c "\"\$0\" -m pytest -p no:cacheprovider -q -rs -x ${TRAIN_TESTS[*]} >\"\$1/trainer/pytest_trainer.txt\" \
2>&1; rc=\$?; \"\$0\" scripts/gpu_train_memory.py --precision bf16 --repeats 2 --out \"\$1/trainer/train_memory.json\" \
>\"\$1/trainer/train_memory.txt\" 2>&1 && exit \$rc" "$PY" "$OUT")
RUN3=(bash -c "\"\$0\" launch.py envs prepare && \"\$0\" launch.py run configs/local.toml rollout.engine=vllm \
roles.rollout.gpus_per_rank=1 roles.trainer.gpus_per_rank=1 cluster.share_gpus=true controller.num_steps=3 \
controller.checkpoint_every_steps=0 controller.eval_every_steps=0 controller.eval_greedy=false \
rollout.vllm.gpu_memory_utilization=0.45 trainer.sft_steps=20 cluster.launch_timeout_s=150 \
--run-dir \"\$1/run3\"" "$PY" "$OUT")
VLLM=("$MPIEXEC" -n 2 "$PY" scripts/gpu_vllm_check.py --out "$OUT/vllm" --gpus 1 "${MODEL_ARGS[@]}")
SUMMARY=("$PY" scripts/gpu_check_summary.py "$OUT")
# part name, time limit (s): 120 + 240 + 150 + 90 s at most, so the whole check stays within 10 minutes
STEPS=("kernel 120" "trainer 240" "run3 150" "vllm 90")

if [ "$DRY" = 1 ]; then
  echo "gpu_check (dry) -> $OUT"
  echo "kernel (120 s): ${KERNEL[*]}"
  echo "trainer (240 s): ${TRAINER[*]}"
  echo "run3 (150 s, needs vllm): ${RUN3[*]}"
  echo "vllm (90 s, needs vllm): ${VLLM[*]}"
  echo "summary: ${SUMMARY[*]}"
  exit 0
fi

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible')" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$OUT/nvidia_smi.csv" 2>&1 || true
NO_VLLM=$("$PY" -c "import vllm" 2>&1 | tail -1)
start=$(date +%s)
for step in "${STEPS[@]}"; do
  read -r name limit <<<"$step"
  mkdir -p "$OUT/$name"
  case $name in
    kernel) cmd=("${KERNEL[@]}") ;;
    trainer) cmd=("${TRAINER[@]}") ;;
    run3) rm -rf "$OUT/run3"; cmd=("${RUN3[@]}") ;;
    vllm) cmd=("${VLLM[@]}") ;;
  esac
  if [ -n "$NO_VLLM" ] && { [ "$name" = run3 ] || [ "$name" = vllm ]; }; then
    reason=${NO_VLLM//\"/\'}
    echo "{\"part\": \"$name\", \"skipped\": \"vllm is not importable: $reason\"}" >"$OUT/$name.status.json"
    echo "[gpu_check] $name skipped: vllm is not importable"
    continue
  fi
  t0=$(date +%s)
  timeout "$limit" "${cmd[@]}" >"$OUT/$name.log" 2>&1
  echo "{\"part\": \"$name\", \"rc\": $?, \"wall_s\": $(( $(date +%s) - t0 )), \"limit_s\": $limit}" >"$OUT/$name.status.json"
  echo "[gpu_check] $name done: $(cat "$OUT/$name.status.json")"
done
echo "[gpu_check] all parts in $(( $(date +%s) - start )) s"
"${SUMMARY[@]}"
