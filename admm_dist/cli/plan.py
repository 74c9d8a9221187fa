"""Rehearse a GPU job on this machine's CPU before it runs: will it fit, and how should it be placed?

usage: python -m admm_dist.plan --config FILE.yaml --nproc_per_node P [--nnodes M]
                                --device_memory 80GiB [--json PATH] [overrides ...]

The job is the training command of this config and overrides (checked as the trainer checks
them) launched on M nodes of P GPUs each (W = M x P ranks). Each kind of rank it would have (a
seat's only rank; or a seat group's leader and a follower) is rehearsed at the job's real world
size and shapes, on fake tensors and torch's fake process group: the trainer's own set-up and one
local step of its x-step (admm_dist/training/rehearsal.py). ``model_name`` only needs its
``config.json`` (assets/shapes/ holds Qwen3-8B's and Qwen3-1.7B's).

It prints, per kind of rank, the memory by category and its peak, and the bytes the rank sends
a round; then the verdict: the job fits when every peak is at most 90% of --device_memory (the
CUDA context and the allocator's slack are not counted). When it does not, the first change
that fits is named with its launch line, each rehearsed, tried in the order of what it costs:
more micro-batches, the backbone sharded over a seat's ranks, twice then four times the ranks
per seat, shorter targets.
Exit code 0: fits; 3: does not fit; 2: bad input (one line).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

PROG = "admm_dist.plan"


def table(plans: Sequence[dict], device_memory: int) -> str:
    from admm_dist.training.memory_plan import HEADROOM
    from admm_dist.training.rehearsal import CATEGORIES

    from admm_dist.core.text import size_unit

    unit, size = size_unit(max(p["peak"] for p in plans), smallest="MiB")
    shown = lambda n: f"{n / size:.2f}"  # noqa: E731
    head = [unit] + [f"rank {p['rank']} ({p['kind']})" for p in plans]
    rows = [[c] + [shown(p["memory"][c]) for p in plans] for c in CATEGORIES]
    rows.append(["peak"] + [shown(p["peak"]) for p in plans])
    rows.append([f"device ({HEADROOM:.0%})"] + [shown(int(HEADROOM * device_memory))] * len(plans))
    sent = sorted({k for p in plans for k in p["sent"]})
    for k in sent:
        rows.append([f"sent/round {k} (MiB)"] + [f"{p['sent'].get(k, 0) / (1 << 20):.1f}" for p in plans])
    rows.append(["rehearsed in (s)"] + [f"{p['seconds']:.1f}" for p in plans])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [head] + rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from admm_dist.core.errors import UserError
    from admm_dist.core.text import parse_size
    from admm_dist.training.memory_plan import HEADROOM, find_fix, fits, rehearse_job, workers

    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0], add_help=True)
    ap.add_argument("--nproc_per_node", type=int, required=True, help="GPUs (ranks) per node")
    ap.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    ap.add_argument("--device_memory", required=True, help="memory of one GPU, e.g. 80GiB, 40GB, 24G")
    ap.add_argument("--json", default=None, help="also write the plans and verdict here")
    ap.add_argument("--no_fix", action="store_true", help="do not look for a change that fits")
    args, rest = ap.parse_known_args(argv)
    try:
        try:
            memory = parse_size(args.device_memory)
        except ValueError as e:
            raise ValueError(f"--device_memory {e}") from None
        if args.nproc_per_node < 1 or args.nnodes < 1:
            raise ValueError(f"--nnodes {args.nnodes} --nproc_per_node {args.nproc_per_node}: "
                             "both must be >= 1")
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    pool = workers()
    try:
        plans = rehearse_job(rest, args.nnodes, args.nproc_per_node, memory, pool)
        ok = fits(plans, memory)
        world = args.nnodes * args.nproc_per_node
        print(f"rehearsed: {world} ranks ({args.nnodes} x {args.nproc_per_node}), {args.device_memory} each")
        print(table(plans, memory))
        verdict = {"fits": ok, "plans": plans, "fix": None}
        if ok:
            print(f"verdict: fits (every peak <= {HEADROOM:.0%} of {args.device_memory})")
        else:
            print(f"verdict: does not fit in {args.device_memory}")
            if not args.no_fix:
                fix = find_fix(rest, args.nnodes, args.nproc_per_node, memory, plans, pool,
                               log=lambda line: print(line, flush=True))
                verdict["fix"] = fix
                print(f"fix: {fix['change']}\n  {fix['launch']}" if fix else "fix: none of the changes "
                      "tried fits: use devices with more memory or a smaller backbone")
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    finally:
        pool.shutdown(cancel_futures=True)
    if args.json:
        from admm_dist.core.io import atomic_write_json

        atomic_write_json(args.json, verdict)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
