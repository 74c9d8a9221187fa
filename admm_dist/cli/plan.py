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
import concurrent.futures
import multiprocessing
import re
import sys
from typing import Dict, List, Optional, Sequence, Tuple

PROG = "admm_dist.plan"
HEADROOM = 0.9          # the share of a device's memory a plan may fill
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(GiB|GB|G|MiB|MB|M)?\s*$", re.IGNORECASE)
_UNITS = {"gib": 1 << 30, "g": 1 << 30, "gb": 10 ** 9, "mib": 1 << 20, "m": 1 << 20, "mb": 10 ** 6, "": 1}


def parse_size(text: str) -> int:
    """``80GiB``, ``24G`` (GiB), ``40GB``, ``512MiB`` or a number of bytes -> bytes."""
    m = _SIZE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--device_memory {text!r}: give a size such as 80GiB, 40GB or 24G")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _unit(plans: Sequence[dict]) -> Tuple[str, int]:
    """GiB, or MiB for a job whose every rank holds less than 1 GiB."""
    return ("GiB", 1 << 30) if max(p["peak"] for p in plans) >= 1 << 30 else ("MiB", 1 << 20)


def _one(argv: List[str], world: int, rank: int, per_node: int, device_memory: int) -> dict:
    """One rank's rehearsal (in a process of its own: one fake world per process)."""
    from admm_dist.core import config_file
    from admm_dist.core.libraries import quiet_libraries
    from admm_dist.training.config import TrainConfig
    from admm_dist.training.rehearsal import rehearse

    quiet_libraries()
    cfg = config_file.load(TrainConfig, argv)
    return rehearse(cfg, world, rank, per_node=per_node, device_memory=device_memory).to_dict()


def _kinds(n_nodes: int, world: int) -> List[int]:
    """One rank of each kind: rank 0 (a seat's only rank, or a leader: the most nodes, the
    consensus) and, with k > 1 ranks per seat, rank 1 (a follower)."""
    return [0, 1] if world > n_nodes else [0]


def rehearse_job(argv: List[str], nnodes: int, per_node: int, device_memory: int,
                 pool: Optional[concurrent.futures.Executor] = None) -> List[dict]:
    """Every kind of rank of the job: one in this process, two at a time in ``pool``'s (each
    rehearsal makes a fake world of its own, one per process at a time)."""
    from admm_dist.core import config_file
    from admm_dist.engine.placement import Placement
    from admm_dist.training.config import TrainConfig

    cfg = config_file.load(TrainConfig, argv)      # bad settings: refused here, as the trainer would
    world = nnodes * per_node
    Placement(cfg.n_nodes(), world)                  # a world it cannot place: refused here
    ranks = _kinds(cfg.n_nodes(), world)
    if len(ranks) == 1 or pool is None:
        return [_one(argv, world, r, per_node, device_memory) for r in ranks]
    return list(pool.map(_one, [argv] * len(ranks), [world] * len(ranks), ranks,
                         [per_node] * len(ranks), [device_memory] * len(ranks)))


def workers() -> concurrent.futures.Executor:
    """Two worker processes (spawned: no fake world is inherited), kept for every rehearsal."""
    spawn = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=spawn)


def fits(plans: Sequence[dict], device_memory: int) -> bool:
    return all(p["peak"] <= HEADROOM * device_memory for p in plans)


def table(plans: Sequence[dict], device_memory: int) -> str:
    from admm_dist.training.rehearsal import CATEGORIES

    unit, size = _unit(plans)
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


def _changes(argv: List[str], nnodes: int, per_node: int, resident_fits: bool
             ) -> List[Tuple[str, List[str], int, int]]:
    """The changes tried when a job does not fit, in the order of what they cost: (what, argv,
    nnodes, nproc_per_node). More micro-batches (time only), the backbone sharded over the
    seat's ranks, twice then four times the ranks per seat (sharded), then shorter targets; each
    with the fewest micro-batches the seat group can share. ``resident_fits``: what the job
    holds but its activations fits the device, so fewer activations alone may do."""
    from admm_dist.core import config_file
    from admm_dist.training.config import TrainConfig

    cfg = config_file.load(TrainConfig, argv)
    n, world = cfg.n_nodes(), nnodes * per_node
    k = world // n if world >= n else 1

    def micro(ks: int) -> List[int]:   # micro_batches a seat of ks ranks can share, up to batch_size
        doubled = (cfg.micro_batches * 2 ** i for i in range(8))
        return [m for m in doubled if m <= cfg.batch_size and m % ks == 0]

    out = []
    if resident_fits:
        out += [(f"micro_batches={m}", argv + [f"micro_batches={m}"], nnodes, per_node)
                for m in micro(k) if m > cfg.micro_batches]
    grown = [(k, nnodes)] if k > 1 and not cfg.shard_backbone else []
    grown += [(k * f, nnodes * f) for f in (2, 4) if world >= n]
    for ks, nn in grown:
        for m in micro(ks):
            more = f", {ks} ranks per seat (--nnodes {nn})" if nn != nnodes else ""
            out.append((f"shard_backbone=true, micro_batches={m}{more}",
                        argv + ["shard_backbone=true", f"micro_batches={m}"], nn, per_node))
    for t in (cfg.max_target_tokens // 2, cfg.max_target_tokens // 4):
        if t >= 1:
            m = (micro(k) or [cfg.micro_batches])[-1]
            out.append((f"max_target_tokens={t}, micro_batches={m}",
                        argv + [f"max_target_tokens={t}", f"micro_batches={m}"], nnodes, per_node))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    from admm_dist.core.errors import UserError

    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0], add_help=True)
    ap.add_argument("--nproc_per_node", type=int, required=True, help="GPUs (ranks) per node")
    ap.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    ap.add_argument("--device_memory", required=True, help="memory of one GPU, e.g. 80GiB, 40GB, 24G")
    ap.add_argument("--json", default=None, help="also write the plans and verdict here")
    ap.add_argument("--no_fix", action="store_true", help="do not look for a change that fits")
    args, rest = ap.parse_known_args(argv)
    try:
        memory = parse_size(args.device_memory)
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
                verdict["fix"] = _find_fix(rest, args.nnodes, args.nproc_per_node, memory, plans, pool)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    finally:
        pool.shutdown(cancel_futures=True)
    if args.json:
        from admm_dist.core.io import atomic_write_json

        atomic_write_json(args.json, verdict)
    return 0 if ok else 3


def _find_fix(argv: List[str], nnodes: int, per_node: int, memory: int, plans: Sequence[dict],
              pool: concurrent.futures.Executor) -> Optional[Dict[str, object]]:
    """The first change of :func:`_changes` that fits, each rehearsed."""
    resident_fits = all(p["peak"] - p["memory"]["activations"] <= HEADROOM * memory for p in plans)
    for what, new, n, p in _changes(argv, nnodes, per_node, resident_fits):
        print(f"rehearsing: {what} ...", flush=True)
        try:
            tried = rehearse_job(new, n, p, memory, pool)
        except Exception as e:   # a change the trainer refuses (e.g. sharding while collecting)
            print(f"  refused: {str(e).splitlines()[0][:200]}")
            continue
        peak = max(q["peak"] for q in tried)
        unit, size = _unit(tried)
        print(f"  peak {peak / size:.2f} {unit}: {'fits' if fits(tried, memory) else 'does not fit'}")
        if fits(tried, memory):
            line = f"torchrun --nnodes {n} --nproc_per_node {p} -m admm_dist.train " + " ".join(new)
            print(f"fix: {what}\n  {line}")
            return {"change": what, "argv": new, "nnodes": n, "nproc_per_node": p, "peak": peak}
    print("fix: none of the changes tried fits: use devices with more memory or a smaller backbone")
    return None


if __name__ == "__main__":
    sys.exit(main())
