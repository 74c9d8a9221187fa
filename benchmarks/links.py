"""Consensus on bandwidth-limited links: seconds per z-step and bytes per node, side by side.

    sudo python -m benchmarks.links [--nodes 2,4,8] [--rates loopback,1gbit,100mbit]
        [--sizes 16,90] [--modes coordinator,ring,gossip,decentralized] [--compress none,int8,fp8]
        [--reps 1] [--json FILE] [--png FILE]

Every rank lives in a network namespace of its own, and every namespace hangs off one Linux
bridge (in a namespace of its own too) by a veth pair of MTU 1500. Each pair is shaped in both
directions with ``tc qdisc ... tbf rate R`` (its burst holds whole frames, so none is dropped),
so a rank sends and receives at most R, like a host on a switch port of that speed. This kernel
has tbf, htb and bridges but no netem: bandwidth is emulated, delay is not. ``loopback`` is the
unshaped row: every rank on this host's ``lo``, no namespaces.

For each rate and N, one launch of N gloo ranks measures every mode (on a ring graph; gossip
with one mixing step) with every payload (fp32, int8, fp8) and vector size: one warm-up
z-step, then ``--reps`` timed ones between barriers. A z-step's seconds are rank 0's wall time
of one ``consensus_`` (the slowest rank sets it: the barrier after it waits for every rank);
bytes are what the meter counts for rank 0's node, which the loopback test checks against the
interface counters; its *wire time* is those bytes (the larger of sent and received) at the
link's rate, the least time the payload can take, printed beside the seconds. The codec's own
encode and decode rates on one thread of this CPU (GB/s of fp32 in and out) are printed too, so
a reader sees which of the two bounds each cell. It needs root, iproute2 (``ip``, ``tc``) and
nsenter; without them it says so in one line and exits 2. Every namespace it makes is deleted
on the way out, by name.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from admm_dist.bench.common import descendants, load_str, write_json

MODES = ("coordinator", "ring", "gossip", "decentralized")
LOOPBACK = "loopback"
MTU = 1500
WORKER_TIMEOUT_S = 1800.0
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class LinksError(RuntimeError):
    """The benchmark cannot run here, or a launch failed; the message says why."""


# --------------------------------------------------------------------------- settings
def rate_bits(rate: str) -> float:
    """``100mbit`` -> 1e8 (bits per second)."""
    for unit, mult in RATE_UNITS.items():
        if rate.endswith(unit):
            try:
                return float(rate[: -len(unit)]) * mult
            except ValueError:
                break
    raise LinksError(f"rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit (or {LOOPBACK})")


def burst_bytes(rate: str) -> int:
    """tbf's bucket: at least 1/100 s of traffic (the kernel's timer granularity is 1/250 s) and
    never below 64 KiB, so a full-size frame, or a GSO burst of them, is never dropped."""
    return max(64 * 1024, int(rate_bits(rate) / 8 / 100))


def missing() -> Optional[str]:
    """Why the shaped links cannot be built here (None: they can)."""
    for b in ("ip", "tc", "nsenter"):
        if shutil.which(b) is None and shutil.which(b, path="/usr/sbin:/sbin") is None:
            return f"{b} is not installed (apt-get install iproute2 util-linux)"
    if os.geteuid() != 0:
        return "network namespaces and tc need root: run it as root (sudo python -m benchmarks.links)"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") or name


def _run(*cmd: str) -> None:
    r = subprocess.run([_tool(cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise LinksError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")


# --------------------------------------------------------------------------- the network
class Star:
    """N namespaces on one bridge, each by a veth pair of MTU 1500; shaped by :meth:`shape`.

    ``addr[i]`` is rank i's address, ``ns[i]`` its namespace; every rank's interface is
    ``eth0`` (one name for GLOO_SOCKET_IFNAME on every rank)."""

    def __init__(self, n: int) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
        self.n = n
        self.switch = f"admml{tag}s"
        self.ns = [f"admml{tag}n{i}" for i in range(n)]
        self.ports = [f"p{i}" for i in range(n)]
        subnet = random.randrange(1, 255)
        self.addr = [f"10.199.{subnet}.{i + 1}" for i in range(n)]
        self.made: List[str] = []

    def __enter__(self) -> "Star":
        try:
            _run("ip", "netns", "add", self.switch)
            self.made.append(self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.ns):
                _run("ip", "netns", "add", ns)
                self.made.append(ns)
                # made inside the node's namespace, its peer moved to the switch's
                _run("ip", "-n", ns, "link", "add", "eth0", "mtu", str(MTU), "type", "veth",
                     "peer", "name", self.ports[i], "mtu", str(MTU))
                _run("ip", "-n", ns, "link", "set", self.ports[i], "netns", self.switch)
                _run("ip", "-n", self.switch, "link", "set", self.ports[i], "master", "br0")
                _run("ip", "-n", self.switch, "link", "set", self.ports[i], "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for ns in reversed(self.made):   # deleting a namespace deletes its ends of the pairs
            subprocess.run([_tool("ip"), "netns", "del", ns], capture_output=True, timeout=60)
        self.made = []

    def shape(self, rate: str) -> None:
        """tbf at ``rate`` on both ends of every pair: a rank's uplink and its downlink."""
        burst = str(burst_bytes(rate))
        for i, ns in enumerate(self.ns):
            for where, dev in ((ns, "eth0"), (self.switch, self.ports[i])):
                _run("tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", burst, "latency", "100ms")

    def prefix(self, i: int) -> List[str]:
        return [_tool("nsenter"), f"--net=/run/netns/{self.ns[i]}"]


# --------------------------------------------------------------------------- one launch
def _launch(n: int, cases: Sequence[Dict[str, Any]], reps: int, folder: str, *,
            star: Optional[Star]) -> List[Dict[str, Any]]:
    """N worker processes (in the star's namespaces, or on loopback); rank 0's figures."""
    out = os.path.join(folder, f"result-{n}-{int(time.time() * 1000)}.json")
    spec = json.dumps({"cases": list(cases), "reps": reps, "out": out})
    port = 29000 + random.randrange(2000)
    procs, logs = [], []
    try:
        for r in range(n):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK="0", OMP_NUM_THREADS="1",
                       MASTER_ADDR=star.addr[0] if star else "127.0.0.1", MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME="eth0" if star else "lo")
            env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            log = open(os.path.join(folder, f"rank{r}.log"), "w")
            logs.append(log)
            cmd = (star.prefix(r) if star else []) + [sys.executable, "-m", "benchmarks.links", "--worker",
                                                      spec]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        end = time.monotonic() + WORKER_TIMEOUT_S
        for r, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise LinksError(f"N={n}: rank {r} ran past {WORKER_TIMEOUT_S:.0f} s "
                                 f"(log {logs[r].name})") from None
            if rc != 0:
                with open(logs[r].name, errors="replace") as fh:
                    tail = fh.read().strip().splitlines()[-3:]
                raise LinksError(f"N={n}: rank {r} exited {rc}: {' | '.join(tail)} (log {logs[r].name})")
    finally:
        for p in procs:
            if p.poll() is None:
                for pid in [p.pid] + descendants(p.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                p.wait(timeout=30)
        for log in logs:
            log.close()
    with open(out) as fh:
        return json.load(fh)


def _worker(spec_text: str) -> int:
    import torch

    from admm_dist.engine.comm import make_communicator
    from admm_dist.engine.comm.meter import CONSENSUS
    from admm_dist.engine.dist import distributed

    torch.set_num_threads(1)
    spec = json.loads(spec_text)
    rows = []
    with distributed("cpu", timeout_s=WORKER_TIMEOUT_S) as ctx:
        for case in spec["cases"]:
            numel = int(case["mib"] * (1 << 20) // 4)
            comm = make_communicator(case["mode"], n_nodes=ctx.world_size, topology="ring",
                                     timeout=ctx.timeout, compress=case["compress"])
            src = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank))
            v = src.clone()
            comm.consensus_([v])   # warm-up: buffers, and the compressed modes' public copies
            secs = []
            for _ in range(spec["reps"]):
                v.copy_(src)
                comm.meter.reset()
                comm.barrier()
                t0 = time.perf_counter()
                comm.consensus_([v])
                comm.barrier()
                secs.append(time.perf_counter() - t0)
            c = comm.meter.total(node=ctx.rank, phase=CONSENSUS)
            rows.append(dict(case, seconds=min(secs), sent=c.sent, recv=c.recv,
                             analytic=comm.analytic_bytes(numel, ctx.rank)))
            comm.close()
            del v, src, comm
    if ctx.rank == 0:
        write_json(spec["out"], rows)
    return 0


def wire_seconds(row: Dict[str, Any], rate: str) -> Optional[float]:
    """The least time a cell's payload takes on links of ``rate``: what rank 0's node sends or
    receives, the larger, at the rate (None on loopback)."""
    return None if rate == LOOPBACK else max(row["sent"], row["recv"]) * 8 / rate_bits(rate)


def codec_rates(numel: int = 1 << 22, reps: int = 5) -> List[Dict[str, Any]]:
    """GB/s of fp32 through each codec on one thread: ``encode`` (a vector to its payload),
    ``encode_change`` (v - h to a payload, h moved by it: what a sender does), ``decode_add``
    (a payload added into a vector: what a receiver does); the best of ``reps``."""
    import torch

    from admm_dist.engine.codec import COMPRESSIONS, codec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        v = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        h, out = torch.zeros(numel), torch.empty(numel)
        rows = []
        for name in [c for c in COMPRESSIONS if c != "none"]:
            c = codec(name)
            payload = torch.empty(c.payload_bytes(numel), dtype=torch.uint8)
            row: Dict[str, Any] = {"compress": name, "numel": numel}
            for what, fn in (("encode", lambda: c.encode_(payload, v)),
                             ("encode_change", lambda: c.encode_(payload, v, h)),
                             ("decode_add", lambda: c.decode_(out, payload, add=True))):
                fn()
                best = min(_timed(fn) for _ in range(reps))
                row[f"{what}_gbps"] = round(4 * numel / best / 1e9, 2)
            rows.append(row)
        return rows
    finally:
        torch.set_num_threads(threads)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def format_codecs(rows: Sequence[Dict[str, Any]]) -> str:
    lines = ["codec on one thread, GB/s of fp32 (a 100 Mbit/s link carries 0.0125 GB/s of payload, "
             "1 Gbit/s 0.125):",
             f"{'payload':>7} {'encode':>7} {'encode v-h':>11} {'decode +=':>10}"]
    lines += [f"{r['compress']:>7} {r['encode_gbps']:>7.2f} {r['encode_change_gbps']:>11.2f} "
              f"{r['decode_add_gbps']:>10.2f}" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the exact-mean scheme
def mean_schemes(n: int, numel: int, compress: str, seed: int = 0) -> Dict[str, Any]:
    """One compressed mean of N random vectors, two ways, against the exact mean: the owner
    scheme the communicators use (each value quantized once on its way to its chunk's owner,
    once on its way back) and a ring that re-quantizes the partial sum at every hop of the
    reduce-scatter (then forwards the owner's codes in the all-gather). Both send the same
    bytes; the relative error of the result is what differs."""
    import torch

    from admm_dist.engine.comm import LocalCommunicator
    from admm_dist.engine.codec import decode_, encode
    from admm_dist.engine.comm.meter import chunk_bounds

    g = torch.Generator().manual_seed(seed)
    vs = [torch.randn(numel, generator=g) for _ in range(n)]
    exact = torch.stack(vs).double().mean(0)
    owner = [v.clone() for v in vs]
    comm = LocalCommunicator(mode="ring", n_nodes=n, compress=compress)
    comm.consensus_(owner)
    ring = torch.empty(numel)
    for c, (lo, hi) in enumerate(chunk_bounds(numel, n)):
        acc = vs[c][lo:hi].clone()
        for j in range(1, n):   # the partial sum travels c -> c+1 -> ..., re-quantized at each hop
            acc = decode_(torch.empty(hi - lo), encode(acc, compress), compress) + vs[(c + j) % n][lo:hi]
        ring[lo:hi] = decode_(torch.empty(hi - lo), encode(acc / n, compress), compress)

    def rel(x):
        return float((x.double() - exact).norm() / exact.norm())
    return {"n": n, "numel": numel, "compress": compress, "owner_rel_error": rel(owner[0]),
            "ring_rel_error": rel(ring), "bytes_per_node": comm.analytic_bytes(numel, 0)}


# --------------------------------------------------------------------------- the whole run
def run(nodes: Sequence[int], rates: Sequence[str], sizes: Sequence[float], modes: Sequence[str],
        compress: Sequence[str], reps: int, folder: str, log=print) -> Dict[str, Any]:
    cases = [dict(mode=m, compress=c, mib=s) for s in sizes for m in modes for c in compress]
    records = []
    t0 = time.monotonic()
    for n in nodes:
        star_ctx = Star(n) if any(r != LOOPBACK for r in rates) else None
        try:
            if star_ctx is not None:
                star_ctx.__enter__()
            for rate in rates:
                star = None if rate == LOOPBACK else star_ctx
                if star is not None:
                    star.shape(rate)
                t = time.monotonic()
                for row in _launch(n, cases, reps, folder, star=star):
                    records.append(dict(row, n=n, rate=rate, wire_s=wire_seconds(row, rate)))
                log(f"# N={n} {rate}: {len(cases)} cases in {time.monotonic() - t:.0f} s")
        finally:
            if star_ctx is not None:
                star_ctx.__exit__()
    return {"settings": dict(nodes=list(nodes), rates=list(rates), sizes_mib=list(sizes), modes=list(modes),
                             compress=list(compress), reps=reps, mtu=MTU, topology="ring", gossip_steps=1,
                             bursts={r: burst_bytes(r) for r in rates if r != LOOPBACK}),
            "records": records, "wall_s": round(time.monotonic() - t0, 1), "load": load_str()}


def format_table(result: Dict[str, Any]) -> str:
    recs = result["records"]
    s = result["settings"]
    lines = [f"seconds per z-step / its payload's wire time (MiB sent per node) on a ring graph; N ranks, "
             f"one per namespace, each link shaped both ways (tbf, MTU {s['mtu']}); {LOOPBACK}: unshaped, "
             "one host"]
    head = f"{'rate':>9} {'MiB':>4} {'mode':<24}" + "".join(f"{f'N={n}':>32}" for n in s["nodes"])
    lines += [head, "-" * len(head)]
    for rate in s["rates"]:
        for mib in s["sizes_mib"]:
            for mode in s["modes"]:
                for c in s["compress"]:
                    cells = []
                    for n in s["nodes"]:
                        r = next((x for x in recs if (x["rate"], x["mib"], x["mode"], x["compress"], x["n"])
                                  == (rate, mib, mode, c, n)), None)
                        wire = "" if r is None or r.get("wire_s") is None else f" / {r['wire_s']:6.3f}"
                        cells.append("-" if r is None else
                                     f"{r['seconds']:7.3f}{wire} ({r['sent'] / 2**20:6.1f} MiB)")
                    lines.append(f"{rate:>9} {mib:>4g} {mode + ('' if c == 'none' else '-' + c):<24}"
                                 + "".join(f"{cell:>32}" for cell in cells))
    lines.append(f"# wall {result['wall_s']:.0f} s; load average after: {result['load']}")
    return "\n".join(lines)


def format_schemes(rows: Sequence[Dict[str, Any]]) -> str:
    lines = ["one compressed mean of N random 4 MiB vectors, relative error against the exact mean "
             "(same bytes per node both ways):",
             f"{'payload':>7} {'N':>3} {'owner (used)':>13} {'ring, per hop':>14} {'bytes/node':>11}"]
    for r in rows:
        lines.append(f"{r['compress']:>7} {r['n']:>3} {r['owner_rel_error']:>13.2e} "
                     f"{r['ring_rel_error']:>14.2e} {r['bytes_per_node']:>11,}")
    return "\n".join(lines)


def plot(result: Dict[str, Any], path: str, rate: str, mib: float) -> None:
    from admm_dist.plots import figures   # matplotlib loads only when a figure is asked for

    s = result["settings"]
    fig = figures.links(result["records"], rate=rate, mib=mib, nodes=s["nodes"], modes=s["modes"],
                        payloads=s["compress"])
    figures.save(fig, path, f"{mib:g} MiB vectors at {rate} per link", "python -m benchmarks.links")


def _list(text: str, kind, allowed: Optional[Sequence[str]] = None) -> list:
    items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if not items or bad:
        raise LinksError(f"{text!r}: give a comma-separated list"
                         + (f" of {', '.join(allowed)}" if allowed else ""))
    return items


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1])
    from admm_dist.engine.comm import COMPRESSIONS

    p = argparse.ArgumentParser(prog="python -m benchmarks.links", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2,4,8")
    p.add_argument("--rates", default=f"{LOOPBACK},1gbit,100mbit")
    p.add_argument("--sizes", default="16,90", help="vector sizes in MiB of fp32")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--compress", default=",".join(COMPRESSIONS))
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None,
                   help="seconds per z-step against N at the last rate and the largest size")
    args = p.parse_args(argv)
    try:
        nodes = _list(args.nodes, int)
        rates = _list(args.rates, str)
        for r in rates:
            if r != LOOPBACK:
                rate_bits(r)
        sizes = _list(args.sizes, float)
        modes = _list(args.modes, str, MODES)
        compress = _list(args.compress, str, COMPRESSIONS)
        if args.reps < 1 or any(n < 2 for n in nodes):
            raise LinksError("--reps must be >= 1 and every N >= 2")
        why = missing() if any(r != LOOPBACK for r in rates) else None
        if why:
            raise LinksError(why)
        # SIGTERM (a job's end, or kill PID) unwinds like an error, so the namespaces are deleted
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        with tempfile.TemporaryDirectory(prefix="admm-links-") as folder:
            result = run(nodes, rates, sizes, modes, compress, args.reps, folder)
    except LinksError as e:
        print(f"links: error: {e}", file=sys.stderr)
        return 2
    result["mean_schemes"] = [mean_schemes(n, 1 << 20, c) for c in compress if c != "none" for n in nodes]
    result["codecs"] = codec_rates()
    print(format_table(result))
    print(format_codecs(result["codecs"]))
    print(format_schemes(result["mean_schemes"]))
    if args.json:
        write_json(args.json, result, f"# wrote {args.json}")
    if args.png:
        plot(result, args.png, rates[-1], max(sizes))
        print(f"# wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
