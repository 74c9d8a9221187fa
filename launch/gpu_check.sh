#!/usr/bin/env bash
# The GPU check (docs/archive/benchmarks-notebook.md, "GPU check"), within 8 minutes on one GPU:
#   0. the x-step's job rehearsed first (python -m admm_dist.plan, no GPU memory): its predicted
#      peak beside the x-step's measured one,
#   1. the x-step benchmark on a random Qwen3-8B-shaped model (bf16, gradient checkpointing,
#      512-token prompts, 256-token targets) against TRL's DPOTrainer, with peak GPU memory per row,
#   2. a random Qwen3-0.6B-shaped backbone, then `python -m admm_dist.train backend=local`
#      (4 seats on the one GPU) end to end with generation_backend hf, and vllm when importable,
#   3. collection tokens/s, hf vs vllm, on that backbone.
# Every step has a time limit; a failed step is recorded and the next one runs. Writes
# OUT_DIR/gpu_check.json, OUT_DIR/gpu_check.md (the table, also printed) and OUT_DIR/logs/.
#
# usage: bash launch/gpu_check.sh [--cpu-smoke] OUT_DIR
#   --cpu-smoke  the same steps on the CPU with tiny shapes (no GPU needed; the tests run it)
# Without a GPU the plain form prints one line and exits 2. Runs from any directory; uses
# python3 from PATH. Exit status: 0 when every step finished or was skipped, 1 when one failed.
set -euo pipefail

usage="usage: bash launch/gpu_check.sh [--cpu-smoke] OUT_DIR"
smoke=()
out=""
for arg in "$@"; do
    case "$arg" in
        --cpu-smoke) smoke=(--cpu-smoke) ;;
        -h|--help) echo "$usage"; exit 0 ;;
        -*) echo "gpu_check: unknown option $arg; $usage" >&2; exit 2 ;;
        *) if [[ -n "$out" ]]; then echo "gpu_check: one OUT_DIR only; $usage" >&2; exit 2; fi
           out="$arg" ;;
    esac
done
if [[ -z "$out" ]]; then
    echo "gpu_check: no OUT_DIR given; $usage" >&2
    exit 2
fi

if [[ ${#smoke[@]} -eq 0 ]]; then
    gpu="$(python3 -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)"
    if [[ "$gpu" != "1" ]]; then
        echo "gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is false); run it on a GPU machine, or pass --cpu-smoke"
        exit 2
    fi
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p -- "$out"
out="$(cd -- "$out" && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m admm_dist.bench.gpu_check "${smoke[@]}" "$out"
