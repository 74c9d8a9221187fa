#!/usr/bin/env bash
# One host, one rank per agent seat (one GPU each when there are GPUs).
#
#   NPROC=4 bash launch/torchrun.sh admm_dist.cli.lsq --consensus ring
#
# On CPU the ranks use gloo over loopback; on GPUs NCCL (chosen from the device).
set -euo pipefail
module=${1:?usage: NPROC=N launch/torchrun.sh MODULE [ARGS...]}
shift
NPROC=${NPROC:-$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | wc -l) || echo 0)}
[ "${NPROC:-0}" -ge 1 ] || NPROC=3
if ! command -v nvidia-smi >/dev/null 2>&1; then
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
fi
exec torchrun --standalone --nproc_per_node "$NPROC" --max-restarts "${MAX_RESTARTS:-0}" -m "$module" "$@"
