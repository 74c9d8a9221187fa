"""Consensus communication benchmark: our ring vs gloo's all_reduce vs one gossip step.

Run::

    python -m admm_dist.bench.comm [--json PATH] [--sizes 1,16,90] [--nprocs 2,4]
                                   [--reps 7] [--quick]

What is measured, for every world size N (one launch of N gloo CPU ranks, one
torch thread each, bound to loopback) and every fp32 vector of ``mib`` MiB
(P = mib * 2^18 elements), side by side in the same processes:

- ``ring``: :class:`~admm_dist.comm.RingCommunicator` ``consensus_`` (our
  reduce-scatter + all-gather on ``isend``/``irecv``, exact mean);
- ``all_reduce``: :class:`~admm_dist.comm.CoordinatorCommunicator`
  ``consensus_``, i.e. torch's built-in ``dist.all_reduce`` (SUM) followed by
  one in-place division by N (the same exact mean the ring returns);
- ``gossip``: :class:`~admm_dist.comm.GossipCommunicator` on the ``ring``
  graph with ``gossip_steps=1`` (each rank exchanges its whole vector with
  each neighbour once and mixes).

Time. Per (N, size), each method gets one warm-up and then ``--reps`` timed
repetitions, interleaved rep by rep (ring, all_reduce, gossip, ring, ...) so
that drift in the machine's load hits all methods alike. Before every
repetition each rank restores its input vector (untimed) and enters a
barrier; each rank then times only the ``consensus_`` call with
``time.perf_counter``. A repetition's time is the maximum over ranks (the
operation is done when the slowest rank is done); the reported figure is the
median over repetitions. ``ratio_to_all_reduce`` is a method's median divided
by the all_reduce median at the same (N, size).

Bytes (separate, untimed operations after the timed ones), per rank:

- ``meter_bytes_per_rank``: mean over ranks of the bytes the communicator's
  :class:`~admm_dist.comm.ByteMeter` recorded as sent in phase ``consensus``
  for one operation (the all_reduce is recorded with the ring convention);
- ``wire_bytes_per_rank``: bytes that crossed the loopback interface, from the
  kernel's ``lo`` tx counter (:func:`~admm_dist.comm.wire.interface_tx_bytes`),
  which is machine-wide. The bracket is: barrier, rank 0 reads the counter,
  barrier, operation, barrier, rank 0 reads again (rank 0 sleeps 20 ms before
  each read so that trailing barrier messages have landed). The second barrier
  before the operation keeps a fast rank from sending before rank 0's first
  read. A baseline bracket with the same barriers and no operation is measured
  the same way and subtracted. Each bracket is repeated ``--wire-trials``
  times and the minimum kept (foreign loopback traffic can only add bytes).
  The result, divided by N, includes TCP/IP headers, ACKs and gloo's message
  headers.
- ``analytic_bytes_per_rank``: mean over ranks of the exact payload: the
  ring all-reduce formula with exact chunk sizes (:func:`ring_bytes_per_rank`,
  2(N-1)/N * 4P up to chunk rounding) for ``ring`` and ``all_reduce``, and
  ``tau * degree_i * 4P`` for ``gossip``.

Load. The 1-minute load average is printed before and after, and the CPU
time other processes used during the run is estimated as the machine's busy
time (``/proc/stat``) minus this process's and its children's CPU time
(approximate: time spent in interrupts may be charged to either side).
"""
from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

METHODS = ("ring", "all_reduce", "gossip")
DEFAULT_SIZES = (1.0, 16.0, 90.0)
DEFAULT_NPROCS = (2, 4)
DEFAULT_REPS = 7
QUICK_SIZES = (1.0, 16.0)
QUICK_REPS = 3
COLLECTIVE_TIMEOUT_S = 600.0
READ_SETTLE_S = 0.02
IFACE = "lo"


def numel_for(mib: float) -> int:
    return int(round(mib * (1 << 20) / 4))


def _make_comms(timeout: datetime.timedelta):
    from ..comm import ByteMeter, CoordinatorCommunicator, GossipCommunicator, RingCommunicator

    return {
        "ring": RingCommunicator(timeout=timeout, meter=ByteMeter()),
        "all_reduce": CoordinatorCommunicator(timeout=timeout, meter=ByteMeter()),
        "gossip": GossipCommunicator(timeout=timeout, topology="ring", gossip_steps=1,
                                     meter=ByteMeter()),
    }


def _wire_bracket(comm, rank: int, op) -> Optional[int]:
    """Loopback tx bytes (machine-wide, read on rank 0) across barrier|barrier op barrier."""
    from ..comm.wire import interface_tx_bytes

    comm.barrier()
    before = None
    if rank == 0:
        time.sleep(READ_SETTLE_S)
        before = interface_tx_bytes(IFACE)
    comm.barrier()
    if op is not None:
        op()
    comm.barrier()
    if rank == 0:
        time.sleep(READ_SETTLE_S)
        after = interface_tx_bytes(IFACE)
        if before is None or after is None:
            return None
        return after - before
    return None


def _rank_main(ctx, sizes: Sequence[float], methods: Sequence[str], warmup: int, reps: int,
               wire_trials: int) -> Dict[str, object]:
    from ..comm import CONSENSUS

    rank, n = ctx.rank, ctx.world_size
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    out: Dict[str, object] = {"rank": rank, "threads": torch.get_num_threads(), "sizes": {}}
    for mib in sizes:
        p = numel_for(mib)
        gen = torch.Generator().manual_seed(1000 + rank)
        src = torch.randn(p, generator=gen)
        v = torch.empty_like(src)
        comms = _make_comms(timeout)
        times: Dict[str, List[float]] = {m: [] for m in methods}
        for rep in range(warmup + reps):
            for m in methods:
                c = comms[m]
                v.copy_(src)
                c.barrier()
                t0 = time.perf_counter()
                c.consensus_([v])
                dt = time.perf_counter() - t0
                if rep >= warmup:
                    times[m].append(dt)
        per_size: Dict[str, object] = {}
        for m in methods:
            c = comms[m]
            # Meter: one operation, sent bytes in phase consensus.
            c.meter.reset()
            v.copy_(src)
            c.barrier()
            c.consensus_([v])
            meter_sent = c.meter.total(node=rank, phase=CONSENSUS).sent
            analytic = c.analytic_bytes(p, rank, v.element_size())
            # Wire: min over trials of the op bracket and of the empty bracket.
            op_deltas, base_deltas = [], []
            for _ in range(wire_trials):
                base_deltas.append(_wire_bracket(c, rank, None))
                v.copy_(src)
                op_deltas.append(_wire_bracket(c, rank, lambda: c.consensus_([v])))
            per_size[m] = {"times_s": times[m], "meter_sent": meter_sent, "analytic": analytic,
                           "wire_op": op_deltas, "wire_base": base_deltas}
        for c in comms.values():
            c.close()
        del comms, src, v
        out["sizes"][mib] = per_size
    dist.barrier()
    return out


class _CpuClock:
    """Machine busy time (from /proc/stat) and our own CPU time (self + waited-for children)."""

    @staticmethod
    def machine_busy_s() -> Optional[float]:
        try:
            with open("/proc/stat") as fh:
                fields = fh.readline().split()
        except OSError:
            return None
        vals = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
        busy = sum(vals) - vals[3] - vals[4]
        return busy / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def own_s() -> float:
        s = resource.getrusage(resource.RUSAGE_SELF)
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run(sizes: Sequence[float], nprocs: Sequence[int], reps: int, *, warmup: int = 1,
        wire_trials: int = 3, methods: Sequence[str] = METHODS,
        log=print) -> Dict[str, object]:
    """Run the benchmark; returns {"records": [...], "load": {...}}."""
    from ..launcher import launch_cpu

    if reps < 1:
        raise ValueError(f"reps={reps}: need at least one timed repetition")
    load_before = _loadavg()
    busy0, own0, wall0 = _CpuClock.machine_busy_s(), _CpuClock.own_s(), time.perf_counter()
    records: List[Dict[str, object]] = []
    for n in nprocs:
        if n < 2:
            raise ValueError(f"nprocs={n}: a communication benchmark needs at least 2 ranks")
        t = time.perf_counter()
        res = launch_cpu(_rank_main, n, list(sizes), list(methods), warmup, reps, wire_trials,
                         timeout_s=COLLECTIVE_TIMEOUT_S)
        log(f"# N={n}: launch done in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        ranks = [res[r] for r in range(n)]
        for mib in sizes:
            for m in methods:
                per_rank = [rk["sizes"][mib][m] for rk in ranks]
                times = [max(pr["times_s"][i] for pr in per_rank) for i in range(reps)]
                wire_op = per_rank[0]["wire_op"]
                wire_base = per_rank[0]["wire_base"]
                wire = None
                if all(x is not None for x in wire_op + wire_base):
                    wire = (min(wire_op) - min(wire_base)) / n
                analytic = statistics.fmean(pr["analytic"] for pr in per_rank)
                records.append({
                    "n": n, "mib": mib, "method": m, "numel": numel_for(mib),
                    "median_s": statistics.median(times), "times_s": times,
                    "meter_bytes_per_rank": statistics.fmean(pr["meter_sent"] for pr in per_rank),
                    "wire_bytes_per_rank": wire,
                    "analytic_bytes_per_rank": analytic,
                    "wire_over_analytic": (wire / analytic) if wire is not None and analytic else None,
                    "wire_trials_op": wire_op, "wire_trials_baseline": wire_base,
                    "reps": reps, "warmup": warmup, "threads_per_rank": ranks[0]["threads"],
                })
    wall = time.perf_counter() - wall0
    busy1, own1 = _CpuClock.machine_busy_s(), _CpuClock.own_s()
    other = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own1 - own0))
    load = {"loadavg_1min_before": load_before, "loadavg_1min_after": _loadavg(),
            "wall_s": wall, "cpu_cores": os.cpu_count(),
            "other_processes_cpu_s": other,
            "other_processes_cores": (other / wall) if other is not None and wall > 0 else None}
    for rec in records:
        base = next(r for r in records if r["n"] == rec["n"] and r["mib"] == rec["mib"]
                    and r["method"] == "all_reduce") if "all_reduce" in methods else None
        rec["ratio_to_all_reduce"] = rec["median_s"] / base["median_s"] if base else None
        rec.update({"loadavg_1min_before": load["loadavg_1min_before"],
                    "loadavg_1min_after": load["loadavg_1min_after"],
                    "other_processes_cores": load["other_processes_cores"]})
    return {"records": records, "load": load}


def _fmt_bytes(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def format_table(records: Sequence[Dict[str, object]]) -> str:
    head = (f"{'n':>2} {'MiB':>5} {'method':<10} {'median s':>9} {'/all_red':>8} "
            f"{'meter B/rank':>13} {'wire B/rank':>13} {'analytic B/rank':>15} {'wire/an':>8}")
    lines = [head, "-" * len(head)]
    for r in records:
        ratio = r.get("ratio_to_all_reduce")
        woa = r.get("wire_over_analytic")
        lines.append(
            f"{r['n']:>2} {r['mib']:>5g} {r['method']:<10} {r['median_s']:>9.4f} "
            f"{'n/a' if ratio is None else format(ratio, '.3f'):>8} "
            f"{_fmt_bytes(r['meter_bytes_per_rank']):>13} {_fmt_bytes(r['wire_bytes_per_rank']):>13} "
            f"{_fmt_bytes(r['analytic_bytes_per_rank']):>15} "
            f"{'n/a' if woa is None else format(woa, '.4f'):>8}")
    return "\n".join(lines)


def _floats(text: str) -> List[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m admm_dist.bench.comm", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="write the records here (a JSON list), atomically")
    ap.add_argument("--sizes", type=_floats, default=None,
                    help="vector sizes in MiB of fp32, comma-separated (default 1,16,90; --quick 1,16)")
    ap.add_argument("--nprocs", type=_ints, default=list(DEFAULT_NPROCS),
                    help="world sizes, comma-separated (default 2,4)")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"timed repetitions per method after one warm-up (default {DEFAULT_REPS}; --quick {QUICK_REPS})")
    ap.add_argument("--wire-trials", type=int, default=3,
                    help="brackets per wire-byte measurement; the minimum is kept (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 and 16 MiB, 3 reps")
    args = ap.parse_args(argv)
    sizes = args.sizes or list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    reps = args.reps if args.reps is not None else (QUICK_REPS if args.quick else DEFAULT_REPS)
    if args.wire_trials < 1:
        ap.error("--wire-trials must be >= 1")

    print(f"# consensus comm benchmark: sizes {sizes} MiB fp32, N in {args.nprocs}, "
          f"{reps} reps + 1 warm-up, methods {', '.join(METHODS)}; torch {torch.__version__}, "
          f"gloo on {IFACE}, 1 thread/rank", flush=True)
    print(f"# load average (1/5/15 min) before: {_load_str()}", flush=True)
    out = run(sizes, args.nprocs, reps, wire_trials=args.wire_trials,
              log=lambda *a, **k: print(*a, **{**k, "flush": True}))
    records, load = out["records"], out["load"]
    print(format_table(records))
    other = load["other_processes_cores"]
    print(f"# load average (1/5/15 min) after: {_load_str()}")
    print(f"# wall {load['wall_s']:.1f} s on {load['cpu_cores']} cores; other processes used about "
          f"{'n/a' if other is None else format(other, '.2f')} cores on average during the run")
    for n in args.nprocs:
        for mib in sizes:
            r = next((x for x in records if x["n"] == n and x["mib"] == mib and x["method"] == "ring"), None)
            if r is not None and r["ratio_to_all_reduce"] is not None:
                print(f"# N={n} {mib:g} MiB: ring/all_reduce = {r['ratio_to_all_reduce']:.3f} "
                      f"(ring times {', '.join(format(t, '.4f') for t in r['times_s'])})")
    if args.json:
        from ..io import atomic_write_json

        atomic_write_json(args.json, records)
        print(f"# wrote {len(records)} records to {args.json}")
    return 0


def _load_str() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


if __name__ == "__main__":
    sys.exit(main())
