"""``python -m admm_dist.cli.standin train|check``: train the stand-in backbone from scratch, or
measure it through the full chain (:mod:`admm_dist.demo.standin`)."""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

from admm_dist.cli.common import OneLineParser
from admm_dist.core.io import atomic_write_json
from admm_dist.demo import standin


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = OneLineParser(prog="python -m admm_dist.cli.standin", description=standin.__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train the stand-in from scratch and write its folder")
    tr.add_argument("--out", required=True)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int, default=2, help="torch threads (the bytes depend on it)")
    tr.add_argument("--steps", type=int, default=standin.RECIPE["steps"])
    tr.add_argument("--batch", type=int, default=standin.RECIPE["batch"])
    tr.add_argument("--snapshot_every", type=int, default=0,
                    help="also write <out>-stepN every N steps (to choose where to stop)")
    ck = sub.add_parser("check", help="measure the stand-in through the full chain")
    ck.add_argument("--model", default=None, help="stand-in folder (default: the shipped assets/standin)")
    ck.add_argument("--json", default=None, help="also write the figures to this JSON file")
    ck.add_argument("--n", type=int, default=400, help="held-out questions")
    ck.add_argument("--samples", type=int, default=8)
    ck.add_argument("--temperature", type=float, default=0.8)
    ck.add_argument("--top_p", type=float, default=0.95)
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "train":
            info = standin.train(a.out, seed=a.seed, threads=a.threads, steps=a.steps, batch=a.batch,
                         snapshot_every=a.snapshot_every)
            print(json.dumps({"out": os.path.abspath(a.out), "seconds": info["seconds"],
                              "final_loss": info["final_loss"]}))
            return 0
        res = standin.check(a.model, n=a.n, samples=a.samples, temperature=a.temperature, top_p=a.top_p,
                    seed=a.seed, threads=a.threads)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"sampled_acc {res['sampled_acc']:.3f}  mixed_share {res['mixed_share']:.3f}  "
          f"greedy_acc {res['greedy_acc']:.3f}  seat_influence "
          f"{' '.join(f'{x:.3f}' for x in res['seat_influence'])}  ({res['seconds']}s)")
    if a.json:
        atomic_write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
