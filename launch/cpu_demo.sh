#!/usr/bin/env bash
# The CPU default, end to end on the shipped stand-in backbone (assets/standin):
#   1. accuracy of the untrained 4-seat chain on chain_arith's evaluation rows,
#   2. on-policy collection + consensus ADMM over a ring, one gloo rank per seat,
#   3. accuracy of the chain with the trained consensus adapter on every seat,
# then what the multi-seed learning benchmark (docs/benchmarks.md) measured for this default:
# one run is one seed, and the benchmark's mean gain with its 95% interval is the claim.
# About three minutes on 2 cores. NPROC, CONFIG and PYTHON (the interpreter, as for install.sh)
# may be overridden from the environment, and arguments go to the training command as overrides,
# e.g. report_to=tensorboard (docs/tracking.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONFIG=${CONFIG:-configs/cpu/standin_onpolicy.yaml}
NPROC=${NPROC:-4}
OUT=runs/cpu/standin_onpolicy
RES=results/cpu
EVAL=("$PY" -m admm_dist.evaluate --task chain_arith --n 400 --max_new_tokens 16 --batch_size 400)
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "== before training"
"${EVAL[@]}" --model_name assets/standin --json "$RES/standin-before.json"
echo "== on-policy collection and ADMM training ($NPROC ranks)"
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m admm_dist.train --config "$CONFIG" \
    out="$OUT" report_dir="$RES" overwrite=true "$@"   # the demo replaces its previous run
echo "== after training"
"${EVAL[@]}" --adapter "$OUT-last.safetensors" --train_report "$RES/standin_onpolicy-train.json" \
    --json "$RES/standin-after.json"
"$PY" - "$RES" "$CONFIG" <<'PY'
import json, os, sys
b, a = (json.load(open(f"{sys.argv[1]}/standin-{k}.json")) for k in ("before", "after"))
print(f"this run (one seed): greedy chain accuracy on {a['n']} evaluation rows {b['accuracy']:.3f} -> {a['accuracy']:.3f}")
bench = "docs/bench_fidelity.json"
if sys.argv[2] == "configs/cpu/standin_onpolicy.yaml" and os.path.isfile(bench):
    s = json.load(open(bench))
    r = s["modes"]["greedy"]["ADMM-ring"]
    lo, hi = r["gain_ci95"]
    print(f"the learning benchmark on this config ({len(s['seeds'])} seeds x {s['eval_n']} rows, "
          f"python -m benchmarks.fidelity): mean gain {100 * r['gain']:+.1f} points "
          f"[95% CI {100 * lo:+.1f}, {100 * hi:+.1f}], better than the base on {r['wins']}/{len(s['seeds'])} seeds")
report = f"{sys.argv[1]}/standin_onpolicy-train.json"
print(f"""What the numbers mean:
- f=[...] in each round line: each seat's training loss (its objective on its own examples) this round;
  primal: how far the seats' adapters are from their consensus; dual: how far the consensus moved this round.
- pass rate in a collection line: the fraction of sampled chains that ended with the right answer.
- accuracy: the fraction of the {a['n']} evaluation rows the 4-seat chain answers right (greedy).
- delta_w_rel in the done line: how far training moved the adapted weights, ||dW|| / ||W||.
evaluation before: {sys.argv[1]}/standin-before.json
evaluation after:  {sys.argv[1]}/standin-after.json
training report:   {report}""")
PY
