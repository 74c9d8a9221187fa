"""How differently the nodes' objectives curve, how strongly against rho, and how near the run
is to a fixed point: the measurement behind "the dual is worth little on the stand-in"
(docs/benchmarks.md).

Run, on a learning benchmark's workdir (``python -m benchmarks.fidelity --workdir W``)::

    python -m benchmarks.curvature --workdir W --seeds 1,2,3,4,5 [--round 4] [--arm ADMM-ring]
        [--probes 2] [--lsq_rounds 4,16,64,400] [--json results/curvature.json]

Why these figures. At the penalty method's fixed point (ADMM-NoDual) every node solves
grad f_i(x_i) + rho (x_i - z) = 0 and z is the nodes' mean. For quadratics with Hessians H_i
this lands on the pooled optimum when every H_i is the same (any rho), and its distance from
it shrinks as rho grows past the curvature (as 1/rho: ``cli.lsq --no_dual``). Two numbers per
direction v say how much the dual has to correct there:

    kappa   = ||Hbar v|| / rho                        the curvature against the coupling
    delta_H = rms_i ||H_i v - Hbar v|| / ||Hbar v||   how differently the nodes curve (0: alike)

with Hbar the nodes' mean Hessian and rho the config's (ADMM-NoDual's; ``rho_adapt`` moves
ADMM-ring's). That bias is a fixed point's: before the run nears one, both methods are in the
same transient. A third number says how far off it is:

    pooled  = ||gbar|| / rms_i ||g_i||                the share of the nodes' gradients they agree on

(1: every node pulls the same way; 0: z is the pooled optimum, where only the dual holds the
nodes' disagreement). H_i v is the central difference of node i's full-batch gradient,
(g_i(z + e v) - g_i(z - e v)) / 2e: exact on a quadratic, and on the chain checked against
half the step (``eps_check``: the relative change of Hbar v). The directions: ``--probes``
random unit vectors (the bulk of the spectrum), and each node's disagreement direction
(g_i - gbar) / ||g_i - gbar|| (where the nodes pull apart, which is what the dual holds). Nodes
without examples (``empty_nodes prox``: f_i = 0) are left out: such a node follows z under
either method and biases neither.

The chain's f_i is the trainer's own (:class:`~admm_dist.training.trainer.Trainer` on the
seed's first collection, the fit set every arm shares) at the arm's z after ``--round`` (the
``-roundR`` file the benchmark keeps; round 0: the initial state), on fixed batches of
``batch_size`` in shard order; its row ends with the benchmark's greedy ADMM-ring minus
ADMM-NoDual after that first collection, when the workdir holds both. The yardstick is
``cli.lsq``'s problem (4 nodes, exact Hessians) with the chain's kind of x-step (8 Adam steps a
round), measured by the same code at ADMM-ring's z after each of ``--lsq_rounds``, beside how
far ADMM-ring and NoDual are from the optimum after as many rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from admm_dist.bench.common import write_json
from benchmarks.fidelity_run import (ARM_NAMES, REFERENCE, BenchError, arm_job, arm_out, first_fitset,
                                     parse_seeds)
from admm_dist.core.errors import UserError

Grad = Callable[[int, torch.Tensor], torch.Tensor]   # (node, x) -> grad f_i(x), full batch
EPS = 0.01          # the central difference's step along a unit direction (eps_check: against EPS/2)
LSQ_RHO = 0.1
LSQ_ROUNDS = (4, 16, 64, 400)
LSQ_XSTEP = {"local_steps": 8, "eta": 0.01}   # as docs/benchmarks.md's least-squares table
PROG = "python -m benchmarks.curvature"


def _rms(vectors: Sequence[torch.Tensor]) -> float:
    """rms_i ||v_i||."""
    return float(torch.stack([v.norm() for v in vectors]).pow(2).mean().sqrt())


def _rms_rel(vectors: Sequence[torch.Tensor], ref: torch.Tensor) -> float:
    """rms_i ||v_i - ref|| / ||ref||."""
    return _rms([v - ref for v in vectors]) / max(float(ref.norm()), 1e-30)


def hvp(grad: Grad, node: int, z: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """H_i v by the central difference of node i's gradient around z along unit v."""
    return (grad(node, z + eps * v) - grad(node, z - eps * v)) / (2 * eps)


def probe(grad: Grad, nodes: Sequence[int], z: torch.Tensor, *, rho: float, probes: int = 2,
          eps: float = EPS, seed: int = 0) -> Dict[str, object]:
    """kappa and delta_H along ``probes`` random directions and each node's disagreement
    direction, each with its step-size check; the nodes' gradients at z and ``pooled``."""
    g = {n: grad(n, z) for n in nodes}
    gbar = sum(g.values()) / len(nodes)
    gen = torch.Generator().manual_seed(seed)
    dirs = [("random", torch.randn(z.numel(), generator=gen, dtype=z.dtype)) for _ in range(probes)]
    dirs += [(f"apart-{n}", g[n] - gbar) for n in nodes if len(nodes) > 1 and float((g[n] - gbar).norm()) > 0]
    rows = []
    for kind, v in dirs:
        v = v / v.norm()
        h = [hvp(grad, n, z, v, eps) for n in nodes]
        hbar = sum(h) / len(nodes)
        half = sum(hvp(grad, n, z, v, eps / 2) for n in nodes) / len(nodes)
        rows.append({"direction": kind, "kappa": float(hbar.norm()) / rho, "delta_H": _rms_rel(h, hbar),
                     "Hv_norm": [float(x.norm()) for x in h],
                     "eps_check": float((half - hbar).norm() / hbar.norm().clamp_min(1e-30))})
    mean = lambda kind, k: _mean([r[k] for r in rows if r["direction"].startswith(kind)])   # noqa: E731
    return {"rho": rho, "grad_norm": [float(g[n].norm()) for n in nodes],
            "pooled": float(gbar.norm()) / max(_rms(list(g.values())), 1e-30), "probes": rows,
            "eps_check": max((r["eps_check"] for r in rows), default=0.0),
            **{kind: {k: mean(kind, k) for k in ("kappa", "delta_H")} for kind in ("random", "apart")}}


def _mean(xs: Sequence[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


# ----------------------------------------------------------------------------- least squares
def lsq_rows(*, probes: int, rho: float = LSQ_RHO, rounds: Sequence[int] = LSQ_ROUNDS,
             one_hessian: bool = True) -> Dict[str, Dict[str, object]]:
    """The yardstick: cli.lsq's problem (4 nodes) with the chain's kind of x-step (8 Adam steps
    a round), measured at ADMM-ring's z after each of :data:`LSQ_ROUNDS`, beside the relative
    distance from the optimum of ADMM-ring and of NoDual after as many rounds; and the same
    problem with one Hessian for every node (``--shared_hessian``) after the last, unless not
    ``one_hessian``."""
    from admm_dist.engine.lsq import LeastSquares, solve

    out: Dict[str, Dict[str, object]] = {}
    for shared in (False, True) if one_hessian else (False,):
        p = LeastSquares(n_nodes=4, shared_hessian=shared)
        data = [p.node_data(i) for i in range(4)]
        grad: Grad = lambda i, x: data[i][0].T @ (data[i][0] @ x - data[i][1])   # noqa: E731
        x_star = p.optimum()
        for k in (rounds[-1:] if shared else rounds):
            z = {name: solve(p, rho=rho, rounds=k, no_dual=no_dual, xstep="adam",
                             **LSQ_XSTEP)[0].z[0].double()
                 for name, no_dual in (("ring", False), ("no_dual", True))}
            row = probe(grad, range(4), z["ring"], rho=rho, probes=probes)
            row.update(rounds=k, shared_hessian=shared,
                       error={name: float((v - x_star).norm() / x_star.norm()) for name, v in z.items()})
            out[f"lsq{', one Hessian' if shared else ''}, {k} rounds"] = row
    return out


# ----------------------------------------------------------------------------- the chain
@dataclasses.dataclass
class ChainPoint:
    """The chain's node objectives at one z: what :func:`probe` measures."""

    grad: Grad
    nodes: List[int]          # the nodes with examples
    z: torch.Tensor
    rho: float
    node_sizes: List[int]     # every node's, the empty ones too


def job_files(workdir: str, seed: int, arm: str, round_: int) -> Tuple[str, str, Optional[str]]:
    """The arm's config, the seed's first collection and z after ``round_`` (None for round 0)
    in a learning benchmark's workdir; a missing one stops the command in one line."""
    job = arm_out(workdir, seed, arm)
    paths = (f"{job}/config.yaml", first_fitset(workdir, seed),
             f"{job}-round{round_}.safetensors" if round_ else None)
    for path in filter(None, paths):
        if not os.path.exists(path):
            raise BenchError(f"{path} does not exist: run python -m benchmarks.fidelity --workdir {workdir} "
                             f"--seeds {seed} --arms {arm} first, and give --round one that ends a "
                             "collection")
    return paths


@contextlib.contextmanager
def chain_point(workdir: str, seed: int, *, arm: str, round_: int,
                model_name: Optional[str] = None) -> Iterator[ChainPoint]:
    """The trainer's f_i on the seed's first collection, at the arm's z after ``round_``; the
    gradient is the mean of the batch losses' gradients over fixed batches in shard order."""
    from admm_dist.core import config_file as config_mod
    from admm_dist.engine.dist import distributed
    from admm_dist.model import batches as bt
    from admm_dist.model import objectives as obj
    from admm_dist.model.vectors import load_vector
    from admm_dist.training.config import TrainConfig
    from admm_dist.training.trainer import Trainer

    config, fitset, vec_path = job_files(workdir, seed, arm, round_)
    with tempfile.TemporaryDirectory() as tmp:
        over = [f"fitset_cache={fitset}", "recollect_every=0", "k_outer=1",
                f"out={tmp}/run", f"report_dir={tmp}", "device=cpu", "quiet=true", "dev_frac=0"]
        cfg = config_mod.load(TrainConfig, ["--config", config, *over,
                                            *([f"model_name={model_name}"] if model_name else [])])
        with distributed("cpu", timeout_s=cfg.timeout_s) as ctx:
            tr = Trainer(cfg, ctx, log=lambda m: None)
            tr.setup()
            tr.build_nodes()
            tr.model.eval()     # no dropout: one f_i, evaluated the same way every time
            z = load_vector(vec_path, tr.adapter)[0] if vec_path else tr.engine.x[0].clone()
            bs = max(1, cfg.batch_size)

            def grad(node: int, x: torch.Tensor) -> torch.Tensor:
                enc = tr.state[node].encoded
                tr.adapter.load_vector(x)
                tr.adapter.zero_grad()
                n_batches = 0
                for i in range(0, len(enc), bs):
                    loss, _ = obj.loss(tr.model, bt.collate(enc[i:i + bs], tr.tokenizer.pad_token_id),
                                       tr.ocfg)
                    loss.backward()
                    n_batches += 1
                return tr.adapter.flat_grad.detach().double() / n_batches

            yield ChainPoint(grad=grad, nodes=[n for n in tr.nodes if tr.state[n].encoded], z=z.double(),
                             rho=cfg.rho, node_sizes=[len(tr.state[n].encoded) for n in tr.nodes])


def chain_row(workdir: str, seed: int, *, arm: str, round_: int, probes: int,
              model_name: Optional[str]) -> Dict[str, object]:
    """One seed's figures at the arm's z after ``round_``, with ring - NoDual per collection."""
    with chain_point(workdir, seed, arm=arm, round_=round_, model_name=model_name) as pt:
        out = probe(pt.grad, pt.nodes, pt.z, rho=pt.rho, probes=probes)
        out.update(seed=seed, nodes=pt.nodes, node_sizes=pt.node_sizes, z_norm=float(pt.z.norm()),
                   gaps=_gaps(workdir, seed, arm))
    return out


def _gaps(workdir: str, seed: int, arm: str) -> Optional[Dict[str, List[float]]]:
    """The arm's greedy accuracy minus ADMM-NoDual's after each collection (the benchmark's
    learning curve), in points, when the workdir holds both jobs."""
    try:
        curves = []
        for name in (arm, "ADMM-NoDual"):
            with open(os.path.join(workdir, f"{arm_job(seed, name)}.json")) as fh:
                curves.append(json.load(fh)["result"]["curve"])
    except (OSError, KeyError, TypeError, ValueError):
        return None
    mean = lambda rows: 100.0 * sum(rows) / len(rows)   # noqa: E731
    return {"rounds": curves[0]["rounds"],
            "minus_no_dual": [mean(a) - mean(b) for a, b in zip(curves[0]["greedy"], curves[1]["greedy"])]}


# ----------------------------------------------------------------------------- command
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, metavar="W", help="a learning benchmark's --workdir")
    p.add_argument("--seeds", required=True, metavar="S,S", help="comma-separated seeds, e.g. 1,2,3,4,5")
    p.add_argument("--arm", default=REFERENCE, choices=ARM_NAMES, metavar="ARM",
                   help=f"whose z to measure at, one of {', '.join(ARM_NAMES)} (default: %(default)s)")
    p.add_argument("--round", type=int, default=4, dest="round_", metavar="R",
                   help="z after this round (its -roundR file; 0: the initial state; default %(default)s, "
                        "the end of the default's first collection)")
    p.add_argument("--probes", type=int, default=2, metavar="N",
                   help="random directions per seed (default %(default)s)")
    p.add_argument("--lsq_rounds", default=",".join(map(str, LSQ_ROUNDS)), metavar="K,K",
                   help="the least-squares yardstick's rows: ADMM-ring's z after these rounds "
                        "(default %(default)s)")
    p.add_argument("--model_name", default=None, metavar="PATH",
                   help="the backbone folder, when the job's path no longer holds")
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure here")
    args = p.parse_args(argv)
    if args.round_ < 0 or args.probes < 0:
        p.error("--round and --probes must be >= 0")
    args.seed_list = parse_seeds(args.seeds)
    try:
        args.lsq_round_list = sorted({int(k) for k in args.lsq_rounds.split(",") if k.strip()})
    except ValueError:
        args.lsq_round_list = []
    if not args.lsq_round_list or args.lsq_round_list[0] < 1:
        p.error(f"--lsq_rounds {args.lsq_rounds!r}: write round counts >= 1 separated by commas, e.g. 4,400")
    return args


def _line(name: str, r: Dict[str, object]) -> str:
    if "error" in r:
        versus = f"{r['error']['ring']:.2g} vs {r['error']['no_dual']:.2g} from the optimum"
    else:
        gaps = r.get("gaps")
        versus = f"{gaps['minus_no_dual'][0]:+.2f} points" if gaps else "-"
    cells = [r["random"]["kappa"], r["random"]["delta_H"], r["apart"]["kappa"], r["apart"]["delta_H"],
             r["pooled"]]
    return f"{name:<32} " + " ".join("      -" if c is None else f"{c:7.3f}" for c in cells) + f"  {versus}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(argv)
        for seed in args.seed_list:
            job_files(args.workdir, seed, args.arm, args.round_)
        t0 = time.time()
        lsq = lsq_rows(probes=args.probes, rounds=args.lsq_round_list)
        summary: Dict[str, object] = {"workdir": args.workdir, "arm": args.arm, "round": args.round_,
                                      "probes": args.probes, "eps": EPS, "lsq": lsq, "seeds": {}}
        print(f"{'':<32} {'random directions':^15} {'apart directions':^15}")
        print(f"{'':<32} {'kappa':>7} {'delta_H':>7} {'kappa':>7} {'delta_H':>7} {'pooled':>7}"
              "  ADMM vs NoDual")
        for name, r in lsq.items():
            print(_line(name, r))
        for seed in args.seed_list:
            r = chain_row(args.workdir, seed, arm=args.arm, round_=args.round_, probes=args.probes,
                          model_name=args.model_name)
            summary["seeds"][str(seed)] = r
            print(_line(f"seed {seed}, round {args.round_}, nodes {','.join(map(str, r['nodes']))}", r),
                  flush=True)
        summary["seconds"] = round(time.time() - t0, 1)
        print(f"\n{len(args.seed_list)} seed(s) in {summary['seconds']:.0f}s")
        if args.json:
            write_json(args.json, summary)
        return 0
    except UserError as e:   # BenchError, or a setting of the job's config
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
