"""``python -m admm_dist.cli.lsq`` (or under torchrun): the engine on distributed least squares.

What it runs is :mod:`admm_dist.engine.lsq`; this module parses the arguments, prints the
rounds and writes the telemetry.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import torch

from admm_dist.cli.common import OneLineParser, run_cli
from admm_dist.core.constants import DEFAULT_TIMEOUT_S
from admm_dist.core.errors import UserError
from admm_dist.core.io import atomic_write_json
from admm_dist.engine import lsq
from admm_dist.engine.admm import RoundRecord
from admm_dist.engine.comm import COMPRESSIONS, MODES, TOPOLOGIES
from admm_dist.engine.dist import distributed

PROG = "python -m admm_dist.cli.lsq"


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m admm_dist.cli.lsq", description=lsq.__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=None,
                   help="number of nodes (default: the torchrun world size, or 3 in one process)")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--consensus", choices=MODES, default="ring")
    p.add_argument("--topology", choices=TOPOLOGIES, default="ring")
    p.add_argument("--gossip_steps", type=int, default=1)
    p.add_argument("--compress", choices=COMPRESSIONS, default="none",
                   help="payload of the z-step: fp32, or int8 / fp8 codes of the change against a public "
                        "copy")
    p.add_argument("--rho", type=float, default=1.0)
    p.add_argument("--k_outer", type=int, default=60)
    p.add_argument("--xstep", choices=["exact", "adam"], default="exact")
    p.add_argument("--local_steps", type=int, default=16)
    p.add_argument("--eta", type=float, default=0.05)
    p.add_argument("--local_only", action="store_true")
    p.add_argument("--no_dual", action="store_true")
    p.add_argument("--shared_hessian", action="store_true",
                   help="every node gets node 0's A, each its own b: one curvature, different optima "
                        "(where --no_dual is exact too)")
    p.add_argument("--timeout_s", type=float, default=DEFAULT_TIMEOUT_S, help="bound on every collective")
    p.add_argument("--json", default=None, help="write the per-round telemetry here (rank 0)")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(PROG, _run, _parser(), argv)


def _run(args) -> int:
    torch.set_num_threads(1)
    with distributed("cpu", timeout_s=args.timeout_s) as ctx:
        n = ctx.world_size if ctx.env.is_distributed else (args.nodes or 3)
        if ctx.env.is_distributed and args.nodes not in (None, n):
            raise UserError(f"--nodes {args.nodes} != world size {n}: drop --nodes or launch "
                            f"torchrun --nproc_per_node {args.nodes}")
        problem = lsq.LeastSquares(n_nodes=n, dim=args.dim, rows=args.rows, seed=args.seed,
                                   shared_hessian=args.shared_hessian)
        x_star = problem.optimum()
        talk = ctx.rank == 0 and not args.quiet

        def on_round(rec: RoundRecord) -> None:
            if talk and (rec.round == 1 or rec.round % 10 == 0 or rec.round == args.k_outer):
                print(f"round {rec.round:4d}  f={sum(rec.f):.5f}  primal={max(rec.primal):.2e}  "
                      f"dual={max(rec.dual):.2e}  sent/node={max(rec.bytes_sent)} B", flush=True)

        engine, history = lsq.solve(problem, consensus=args.consensus, topology=args.topology,
                                gossip_steps=args.gossip_steps, rho=args.rho, rounds=args.k_outer,
                                local_only=args.local_only, no_dual=args.no_dual, xstep=args.xstep,
                                local_steps=args.local_steps, eta=args.eta, timeout=ctx.timeout,
                                on_round=on_round, compress=args.compress)
        z = engine.comm.gather_rows(torch.stack(engine.z).double())
        rel = [float(torch.linalg.vector_norm(z[i] - x_star) / torch.linalg.vector_norm(x_star))
               for i in range(n)]
        summary = {"nodes": n, "consensus": args.consensus, "compress": args.compress, "rounds": args.k_outer,
                   "rel_error_to_optimum": rel,
                   "bytes_sent_per_node": [sum(r.bytes_sent[i] for r in history) for i in range(n)]}
        if ctx.rank == 0:
            print(json.dumps(summary))
            if args.json:
                atomic_write_json(args.json, {"summary": summary,
                                              "rounds": [r.as_dict() for r in history]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
