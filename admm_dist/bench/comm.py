"""Consensus communication benchmark: our ring vs gloo's all_reduce vs one gossip step.

Run::

    python -m admm_dist.bench.comm [--json PATH] [--sizes 1,16,90] [--nprocs 2,4]
                                   [--reps 9] [--wire-trials 5] [--methods ...] [--quick]

For every world size N (one launch of N gloo CPU ranks through
:func:`admm_dist.bench.launcher.launch_cpu`, one torch thread per rank, gloo bound to
loopback) and every fp32 vector of ``mib`` MiB (P = mib * 2^18 elements), the
methods below run side by side in the same processes on the same vectors:

- ``ring``: :class:`~admm_dist.engine.comm.ProcessGroupCommunicator` ``consensus_`` (our
  reduce-scatter + all-gather on ``isend``/``irecv``; the exact mean);
- ``all_reduce``: the same communicator in mode ``coordinator``,
  ``consensus_``: torch's built-in ``dist.all_reduce`` (SUM), then one
  in-place division by N (the same exact mean the ring returns);
- ``gossip``: the same communicator in mode ``gossip`` on the ``ring``
  graph with ``gossip_steps=1`` (each rank exchanges its whole vector with
  each neighbour once and mixes);
- ``all_reduce_sum``: a reference, not a consensus: the same built-in
  ``dist.all_reduce`` (SUM) without the division, i.e. the floor set by gloo.

Time. Per (N, size), each method gets one warm-up and then ``--reps`` timed
repetitions, interleaved rep by rep (ring, all_reduce, gossip,
all_reduce_sum, ring, ...) so that drift in the machine's load hits every
method alike. Before every repetition each rank restores its input vector
(untimed) and enters a barrier; each rank then times only the
``consensus_`` call with ``time.perf_counter``. A repetition's time is the
maximum over ranks (the operation is done when the slowest rank is done);
the reported ``median_s`` is the median over repetitions, and
``ratio_to_all_reduce`` divides it by the ``all_reduce`` median at the same
(N, size). ``paired_ratio_median`` is the median over repetitions of the
method's time over the all_reduce time of the same repetition (adjacent in
time, so slow drift of the machine cancels); the table prints it as ``paired``.

Bytes, from separate untimed operations after the timed ones, per rank:

- ``meter_bytes_per_rank``: mean over ranks of the bytes the communicator's
  :class:`~admm_dist.engine.comm.ByteMeter` recorded as sent, phase ``consensus``,
  in one operation (the built-in all_reduce is recorded with the ring
  convention);
- ``wire_bytes_per_rank``: bytes that crossed the loopback interface, from the
  kernel's machine-wide ``lo`` tx counter
  (:func:`~admm_dist.bench.comm_wire.interface_tx_bytes`), read on rank 0 around one
  operation: barrier, read, barrier, operation, barrier, read (every read comes
  20 ms after its barrier so that trailing messages have landed; the second
  barrier keeps a fast rank from sending before the first read). The same
  bracket with no operation inside is the baseline (barrier traffic, about
  1.3 KB at N = 2); its minimum is subtracted and the result divided by N. It
  includes TCP/IP headers, ACKs, gloo's message headers and TCP
  retransmissions.
- TCP retransmissions. Loopback TCP retransmits here (spuriously: reordering,
  SACK/DSACK, tail-loss probes) when the cores are oversubscribed and a
  receiving thread is descheduled; those bytes are on the wire but are not
  payload. Each rank also reads, around the same brackets, the bytes its own
  TCP sockets sent and retransmitted (``getsockopt(TCP_INFO)``, immune to other
  processes' traffic): ``tcp_retrans_bytes_per_rank`` (mean over ranks),
  ``wire_net_bytes_per_rank`` = wire minus that, and
  ``tcp_payload_bytes_per_rank``: payload sent once (gloo's headers included,
  IP/TCP headers not), baseline subtracted. At least ``--wire-trials``
  brackets are measured, and more (up to 4x as many) while every one had
  retransmissions; the kept bracket is the one with the fewest loopback bytes
  among those without retransmissions, or among all if none is clean.
  ``wire_trials_*`` and ``tcp_trials_retrans_bytes`` hold every bracket.
- ``analytic_bytes_per_rank``: mean over ranks of the exact payload: the ring
  all-reduce formula with exact chunk sizes
  (:func:`~admm_dist.engine.comm.ring_bytes_per_rank`, 2(N-1)/N * 4P up to chunk
  rounding) for ``ring``, ``all_reduce`` and ``all_reduce_sum``, and
  ``tau * degree_i * 4P`` for ``gossip``.

Load. The load average is printed before and after, and for each launch the
mean number of cores used by other processes is estimated as the machine's
task CPU time (user + nice + system in ``/proc/stat``) minus the CPU time of
this process and its ranks, over the wall time.

This module owns the workload (the communicators, the timed and metered operations each rank
runs), the run over world sizes, the table and the command line. Counting the wire bytes is
in :mod:`admm_dist.bench.comm_wire`, the load accounting in :mod:`admm_dist.bench.common`.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from admm_dist.bench.comm_wire import IFACE, wire_bracket, wire_fields
from admm_dist.bench.common import Column, CpuWindow, format_rows, load_str, loadavg, num, write_json

METHODS = ("ring", "all_reduce", "gossip", "all_reduce_sum")
DEFAULT_SIZES = (1.0, 16.0, 90.0)
DEFAULT_NPROCS = (2, 4)
DEFAULT_REPS = 15
QUICK_SIZES = (1.0, 16.0)
QUICK_REPS = 3
COLLECTIVE_TIMEOUT_S = 600.0
WIRE_TRIALS_CAP_FACTOR = 4


def numel_for(mib: float) -> int:
    return int(round(mib * (1 << 20) / 4))


def _make_comms(timeout: datetime.timedelta, methods: Sequence[str]):
    from admm_dist.engine.comm import ByteMeter, ProcessGroupCommunicator

    n = dist.get_world_size()

    class SumOnly(ProcessGroupCommunicator):
        """Reference only: gloo's all_reduce (SUM) without the division (not a consensus)."""

        def consensus_(self, vectors):
            (v,) = vectors
            self.meter.add(self.rank, "all_reduce",
                           **self.ring_convention(v.numel(), self.rank, v.element_size()))
            self._sum_ranks(v)

    def comm(cls=ProcessGroupCommunicator, **kw):
        return cls(n_nodes=n, timeout=timeout, meter=ByteMeter(), **kw)

    make = {
        "ring": lambda: comm(mode="ring"),
        "all_reduce": lambda: comm(mode="coordinator"),
        "gossip": lambda: comm(mode="gossip", topology="ring", gossip_steps=1),
        "all_reduce_sum": lambda: comm(SumOnly, mode="coordinator"),
    }
    return {m: make[m]() for m in methods}


def _rank_main(ctx, sizes: Sequence[float], methods: Sequence[str], warmup: int, reps: int,
               wire_trials: int) -> Dict[str, object]:
    from admm_dist.engine.comm import CONSENSUS

    rank = ctx.rank
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    out: Dict[str, object] = {"rank": rank, "threads": torch.get_num_threads(), "sizes": {}}
    for mib in sizes:
        p = numel_for(mib)
        gen = torch.Generator().manual_seed(1000 + rank)
        src = torch.randn(p, generator=gen)
        v = torch.empty_like(src)
        comms = _make_comms(timeout, methods)
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
            # Wire: brackets around one operation, and empty brackets (the baseline). At least
            # ``wire_trials`` of each; more (up to WIRE_TRIALS_CAP_FACTOR times as many) while
            # every operation bracket had TCP retransmissions, so that a clean one is likely.
            op_deltas, base_deltas = [], []
            clean = False
            while True:
                base_deltas.append(wire_bracket(c, rank, None))
                v.copy_(src)
                op_deltas.append(wire_bracket(c, rank, lambda: c.consensus_([v])))
                sock = op_deltas[-1][1]
                # [retransmitted bytes, ranks that cannot tell], summed over ranks
                rtx = torch.tensor([0, 1] if sock is None else [sock[1], 0], dtype=torch.int64)
                dist.all_reduce(rtx, op=dist.ReduceOp.SUM)
                clean = clean or rtx[0].item() == 0 or rtx[1].item() > 0
                k = len(op_deltas)
                if k >= wire_trials * WIRE_TRIALS_CAP_FACTOR or (k >= wire_trials and clean):
                    break
            per_size[m] = {"times_s": times[m], "meter_sent": meter_sent, "analytic": analytic,
                           "wire_op": op_deltas, "wire_base": base_deltas}
        for c in comms.values():
            c.close()
        del comms, src, v
        out["sizes"][mib] = per_size
    dist.barrier()
    return out


def run(sizes: Sequence[float], nprocs: Sequence[int], reps: int, *, warmup: int = 1,
        wire_trials: int = 5, methods: Sequence[str] = METHODS,
        log=print) -> Dict[str, object]:
    """Run the benchmark; returns {"records": [...], "load": {...}}."""
    from admm_dist.bench.launcher import launch_cpu

    if reps < 1:
        raise ValueError(f"reps={reps}: need at least one timed repetition")
    load_before = loadavg()
    whole = CpuWindow.start()
    records: List[Dict[str, object]] = []
    for n in nprocs:
        if n < 2:
            raise ValueError(f"nprocs={n}: a communication benchmark needs at least 2 ranks")
        launch = CpuWindow.start()
        res = launch_cpu(_rank_main, n, list(sizes), list(methods), warmup, reps, wire_trials,
                         timeout_s=COLLECTIVE_TIMEOUT_S)
        dt, other_n = launch.stop()
        log(f"# N={n}: done in {dt:.1f} s; other processes used about "
            f"{'n/a' if other_n is None else format(other_n, '.2f')} cores meanwhile")
        ranks = [res[r] for r in range(n)]
        for mib in sizes:
            for m in methods:
                per_rank = [rk["sizes"][mib][m] for rk in ranks]
                times = [max(pr["times_s"][i] for pr in per_rank) for i in range(reps)]
                analytic = statistics.fmean(pr["analytic"] for pr in per_rank)
                records.append({
                    "n": n, "mib": mib, "method": m, "numel": numel_for(mib),
                    "median_s": statistics.median(times), "times_s": times,
                    "meter_bytes_per_rank": statistics.fmean(pr["meter_sent"] for pr in per_rank),
                    "analytic_bytes_per_rank": analytic,
                    **wire_fields(per_rank, n, analytic),
                    "reps": reps, "warmup": warmup, "threads_per_rank": ranks[0]["threads"],
                    "other_processes_cores_during_launch": other_n,
                })
    wall, other = whole.stop()
    load = {"loadavg_1min_before": load_before, "loadavg_1min_after": loadavg(),
            "wall_s": wall, "cpu_cores": os.cpu_count(), "other_processes_cores": other}
    for rec in records:
        base = next(r for r in records if r["n"] == rec["n"] and r["mib"] == rec["mib"]
                    and r["method"] == "all_reduce") if "all_reduce" in methods else None
        rec["ratio_to_all_reduce"] = rec["median_s"] / base["median_s"] if base else None
        # Same repetition, same machine state: the ratio pair by pair cancels drift.
        rec["paired_ratio_median"] = (statistics.median(
            a / b for a, b in zip(rec["times_s"], base["times_s"]) if b > 0) if base else None)
        rec.update({"loadavg_1min_before": load["loadavg_1min_before"],
                    "loadavg_1min_after": load["loadavg_1min_after"],
                    "other_processes_cores": load["other_processes_cores"]})
    return {"records": records, "load": load}


def _bytes(x: Optional[float]) -> str:
    return num(x, ",.0f")


def _ratio(num_: Optional[float], den: Optional[float], digits: int = 4) -> str:
    return "n/a" if num_ is None or not den else format(num_ / den, f".{digits}f")


COLUMNS = (
    Column("n", 2, lambda r: str(r["n"])),
    Column("MiB", 5, lambda r: format(r["mib"], "g")),
    Column("method", 14, lambda r: r["method"], "<"),
    Column("median s", 9, lambda r: format(r["median_s"], ".4f")),
    Column("/all_red", 8, lambda r: _ratio(r.get("ratio_to_all_reduce"), 1.0, 3)),
    Column("paired", 6, lambda r: _ratio(r.get("paired_ratio_median"), 1.0, 3)),
    Column("meter B/rank", 13, lambda r: _bytes(r["meter_bytes_per_rank"])),
    Column("wire B/rank", 13, lambda r: _bytes(r["wire_bytes_per_rank"])),
    Column("analytic B/rank", 15, lambda r: _bytes(r["analytic_bytes_per_rank"])),
    Column("wire/an", 7, lambda r: _ratio(r["wire_bytes_per_rank"], r["analytic_bytes_per_rank"])),
    Column("rtx B/rank", 10, lambda r: _bytes(r.get("tcp_retrans_bytes_per_rank"))),
    Column("net/an", 7, lambda r: _ratio(r.get("wire_net_bytes_per_rank"), r["analytic_bytes_per_rank"])),
    Column("tcp/an", 7, lambda r: _ratio(r.get("tcp_payload_bytes_per_rank"), r["analytic_bytes_per_rank"])),
)


def format_table(records: Sequence[Dict[str, object]]) -> str:
    """One row per (n, MiB, method); byte columns are per rank, ratios are to the analytic payload."""
    lines = format_rows(COLUMNS, records)
    lines.append("wire = loopback tx bytes (headers, ACKs, retransmissions included); rtx = bytes our "
                 "sockets retransmitted in that bracket; net = wire - rtx; tcp = payload our sockets "
                 "sent, retransmissions excluded")
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
                    help="timed repetitions per method after one warm-up "
                         f"(default {DEFAULT_REPS}; --quick {QUICK_REPS})")
    ap.add_argument("--wire-trials", type=int, default=5,
                    help="wire-byte brackets per method and size, at least (default 5; up to 4x as "
                         "many while all of them saw TCP retransmissions)")
    ap.add_argument("--methods", type=lambda t: [m.strip() for m in t.split(",") if m.strip()],
                    default=list(METHODS), help=f"methods to time (default {','.join(METHODS)})")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 and 16 MiB, 3 reps")
    args = ap.parse_args(argv)
    sizes = args.sizes or list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    reps = args.reps if args.reps is not None else (QUICK_REPS if args.quick else DEFAULT_REPS)
    if args.wire_trials < 1:
        ap.error("--wire-trials must be >= 1")
    if reps < 1:
        ap.error("--reps must be >= 1")
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or not args.methods:
        ap.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")

    print(f"# consensus comm benchmark: sizes {sizes} MiB fp32, N in {args.nprocs}, "
          f"{reps} reps + 1 warm-up, methods {', '.join(args.methods)}; torch {torch.__version__}, "
          f"gloo on {IFACE}, 1 thread/rank", flush=True)
    print(f"# load average (1/5/15 min) before: {load_str()}", flush=True)
    out = run(sizes, args.nprocs, reps, wire_trials=args.wire_trials, methods=args.methods,
              log=lambda *a: print(*a, flush=True))
    records, load = out["records"], out["load"]
    print(format_table(records))
    other = load["other_processes_cores"]
    print(f"# load average (1/5/15 min) after: {load_str()}")
    print(f"# wall {load['wall_s']:.1f} s on {load['cpu_cores']} cores; other processes used about "
          f"{'n/a' if other is None else format(other, '.2f')} cores on average during the run")
    for r in records:
        print(f"# N={r['n']} {r['mib']:g} MiB {r['method']}: times "
              f"{' '.join(format(t, '.4f') for t in r['times_s'])}")
    if args.json:
        write_json(args.json, records, f"# wrote {len(records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
