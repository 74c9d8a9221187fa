"""What fits where: configs/admm_ring.yaml (the seed's Table A2 settings) rehearsed in Qwen3-8B's and
Qwen3-1.7B's shapes (assets/shapes/), 4 seats on 4, 8 and 16 ranks and 8 seats on 64, whole and
sharded, with the fewest micro-batches a seat group can share and with 8 (one DPO pair a part);
the peak of the job's ranks, and which of 24, 40 and 80 GiB devices hold it (every peak at most
90%: ``admm_dist.plan``'s rule). Qwen3-8B at the config's longest examples (8192 + 4096 tokens)
and both shapes at 2048 + 1024.

    python -m benchmarks.rehearsal_table [--json PATH]     # about 25 minutes on one core

Prints a markdown table (docs/placement.md holds it) with the launch line of each row."""
from __future__ import annotations

import argparse
import json
import time

from admm_dist.training.memory_plan import HEADROOM, rehearse_job

# (folder, layers): LoRA on every layer, as the seed's 36 of Qwen3-8B
SHAPES = {"Qwen3-8B": ("assets/shapes/qwen3-8b", 36), "Qwen3-1.7B": ("assets/shapes/qwen3-1.7b", 28)}
# the config's longest examples (its max_prompt_tokens and max_target_tokens), and shorter ones
CASES = (("Qwen3-8B", (8192, 4096)), ("Qwen3-8B", (2048, 1024)), ("Qwen3-1.7B", (2048, 1024)))
JOBS = [(4, 4, False), (4, 8, False), (4, 8, True), (4, 16, False), (4, 16, True),   # (seats, ranks, sharded)
        (8, 64, False), (8, 64, True)]
DEVICES = (24, 40, 80)   # GiB
BATCH = 8                # configs/admm_ring.yaml's batch_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name, (prompt, target) in CASES:
        folder, layers = SHAPES[name]
        for seats, world, sharded in JOBS:
            k = max(1, world // seats)
            per_node = min(world, 8)
            for micro in sorted({k, BATCH}):
                argv = ["--config", "configs/admm_ring.yaml", f"model_name={folder}", f"n_agents={seats}",
                        f"lora_layers_last={layers}", f"max_prompt_tokens={prompt}",
                        f"max_target_tokens={target}", f"micro_batches={micro}"]
                argv += ["shard_backbone=true"] if sharded else []
                t = time.monotonic()
                plans = rehearse_job(argv, world // per_node, per_node, 80 << 30)
                peak = max(p["peak"] for p in plans)
                rows.append({"model": name, "tokens": f"{prompt} + {target}", "seats": seats, "world": world,
                             "sharded": sharded,
                             "micro_batches": micro, "peak": peak, "argv": argv, "nnodes": world // per_node,
                             "nproc_per_node": per_node, "seconds": round(time.monotonic() - t, 1)})
                print(json.dumps(rows[-1]), flush=True)
    print("\n| model | prompt + target | seats | ranks | backbone | micro_batches | peak GiB | " +
          " | ".join(f"{d} GiB" for d in DEVICES) + " | launch |")
    print("| --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in DEVICES) + " | --- |")
    for r in rows:
        fit = ["yes" if r["peak"] <= HEADROOM * (d << 30) else "no" for d in DEVICES]
        print(f"| {r['model']} | {r['tokens']} | {r['seats']} | {r['world']} | "
              f"{'sharded' if r['sharded'] else 'whole'} | "
              f"{r['micro_batches']} | {r['peak'] / (1 << 30):.1f} | " + " | ".join(fit) +
              f" | `--nnodes {r['nnodes']} --nproc_per_node {r['nproc_per_node']}` " +
              " ".join(a for a in r["argv"][2:] if not a.startswith("model_name=")) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
