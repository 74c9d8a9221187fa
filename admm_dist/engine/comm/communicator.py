"""The communicator the ADMM engine talks to: every consensus algorithm, written once.

A communicator owns a set of *nodes* (training seats): a block of them per rank under torchrun,
all of them in one process otherwise; the engine hands it one flat vector per node and never
sees ranks. ``consensus_`` replaces each v_i in place: ``coordinator`` by the exact mean (each
process sums its nodes in node order, one sum over the ranks, then / N); ``ring`` by the exact
mean as a chunked ring all-reduce; ``gossip`` by ``tau`` Metropolis mixing steps;
``decentralized`` by one step of v_i <- (v_i + mean_{j in N_i} v_j) / 2 (fed x:
:mod:`admm_dist.engine.admm`); with ``compress``, by their compressed variants (:mod:`~.compressed`).

Each algorithm is a schedule of node-to-node messages (:class:`Hop`) over all N nodes. The
transport (:meth:`Communicator.relay`, :meth:`Communicator.exchange`) moves the hops that touch
this process: in memory between two of its nodes, ``isend``/``irecv`` between ranks. So the
single-process oracle runs the same code as every placement, bit for bit (but the coordinator's
sum over ranks, whose order is the backend's). Bytes are counted once, in the transport:
``consensus`` on the wire, ``in_process`` copied in memory (the oracle counts every hop as the
wire bytes of an N-rank run).
"""
from __future__ import annotations

import abc
import collections
import itertools
import re
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from admm_dist.core.errors import RunError, UserError
from admm_dist.engine.comm import compressed
from admm_dist.engine.codec import check_compress
from admm_dist.engine.comm.meter import CONSENSUS, IN_PROCESS, TELEMETRY, ByteMeter, chunk_bounds, ring_bytes_per_rank
from admm_dist.engine.comm.schedule import Hop, Step, pieces
from admm_dist.engine.comm.topology import (DECENTRALIZED, MIXING, check_mode, half_mean_weights,
                                             metropolis_weights, neighbours)


class CommError(RunError):
    """A communication step failed (a peer died, timed out, or disagreed)."""


_GLOO_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\] ")        # "[.../gloo/transport/tcp/pair.cc:553] "
_GLOO_ADVICE = re.compile(r"\.? This is typically caused by .*$")   # "... Check the logs ... GLHF! 🏖️"


def first_line(e: BaseException) -> str:
    """A backend's error as one short line (gloo and NCCL raise long multi-line texts): its first
    line, the cause kept ("Connection closed by peer [10.0.0.1]:6043"), gloo's source location and
    closing advice dropped."""
    text = str(e).strip()
    line = _GLOO_ADVICE.sub("", _GLOO_SOURCE.sub("", text.splitlines()[0])) if text else ""
    return line[:300] or type(e).__name__


def wait_all(works: Sequence, timeout, what: str, rank: int) -> None:
    """Wait for every pending operation, each bounded by ``timeout``; a failure or a timeout is
    a :class:`CommError` naming the rank and the step."""
    start = time.monotonic()
    try:
        for w in works:
            w.wait(timeout)
    except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with long texts
        elapsed, bound = time.monotonic() - start, timeout.total_seconds()
        how = (f"timed out after {bound:.0f}s" if elapsed >= 0.9 * bound else
               f"failed after {elapsed:.1f}s (a peer closed the connection or stopped, not a timeout)")
        raise CommError(f"rank {rank}: {what} {how} ({first_line(e)})") from e


class Communicator(abc.ABC):
    """Exchanges flat vectors between the N nodes of one ADMM problem; the subclasses are the
    transports (:class:`~.local.LocalCommunicator`, :class:`~.process_group.ProcessGroupCommunicator`)."""

    def __init__(self, *, mode: str, n_nodes: int, blocks: Sequence[range], rank: int, topology: str = "ring",
                 gossip_steps: int = 1, meter: Optional[ByteMeter] = None, compress: str = "none") -> None:
        check_mode(mode, topology, gossip_steps)
        if n_nodes < 1:
            raise UserError(f"n_nodes={n_nodes}: a consensus problem needs at least one node")
        self.compress = check_compress(compress)
        self.compress_state: Dict[int, Dict[str, torch.Tensor]] = {}   # per node: compressed.py's public copies
        self.mode = mode
        self.n_nodes = int(n_nodes)
        self.blocks, self.rank = list(blocks), rank   # the nodes of each rank, in rank order; this rank
        self.owner = [r for r, block in enumerate(self.blocks) for _ in block]   # the rank of each node
        self.nodes: Tuple[int, ...] = tuple(self.blocks[rank])
        self.topology = topology
        self.gossip_steps = int(gossip_steps)
        self.meter = meter if meter is not None else ByteMeter()
        self.neighbours: List[List[int]] = neighbours(topology, self.n_nodes)
        self.weights = (half_mean_weights if mode == DECENTRALIZED else metropolis_weights)(self.neighbours)
        self._scratch: Dict[object, torch.Tensor] = {}

    # -- placement ------------------------------------------------------------------------
    def rank_blocks(self) -> List[range]:
        """The nodes of each rank, in rank order."""
        return list(self.blocks)

    def mine(self, node: int) -> bool:
        """Whether ``node`` lives in this process."""
        return self.owner[node] == self.rank

    @property
    def exact(self) -> bool:
        """True when consensus_ returns the exact mean (every z_i is one point z)."""
        return self.mode not in MIXING or self.n_nodes == 1

    # -- bytes ------------------------------------------------------------------------------
    def analytic_bytes(self, numel: int, node: int, itemsize: int = 4) -> int:
        """Bytes ``node`` sends in one consensus_ of ``numel`` items (ring convention for all_reduce)."""
        if self.n_nodes == 1:
            return 0
        if self.compress != "none":
            return compressed.bytes_sent(self, numel, node)
        if self.mode in MIXING:
            return self.gossip_steps * len(self.neighbours[node]) * numel * itemsize
        return ring_bytes_per_rank(numel, self.n_nodes, node, itemsize)

    def ring_convention(self, numel: int, node: int, itemsize: int = 4) -> dict:
        """What a ring all-reduce would send from ``node`` and deliver to it (from its left)."""
        n = self.n_nodes
        return {"sent": ring_bytes_per_rank(numel, n, node, itemsize),
                "recv": ring_bytes_per_rank(numel, n, (node - 1) % n, itemsize)}

    # -- per-node state of compressed consensus (checkpointed with the node) -----------------
    def node_state(self, node: int) -> Dict[str, torch.Tensor]:
        return dict(self.compress_state.get(node, {}))

    def load_node_state(self, node: int, tensors: Dict[str, torch.Tensor]) -> None:
        self.compress_state[node] = {k: t.detach().clone() for k, t in tensors.items()}

    # -- the transport --------------------------------------------------------------------
    def exchange(self, hops: Sequence[Hop], what: str) -> Dict[Tuple[int, int], torch.Tensor]:
        """Move the hops that touch this process (a relay of one step; every hop of one length).
        Returns, per hop into one of its nodes, keyed (src, dst), the sender's own tensor (no copy)
        or ``into``."""
        self.relay([Step(hops)], what, max((t.nbytes for h in hops for t in (h.data, h.into) if t is not None), default=0))
        return {(h.src, h.dst): h.data if self.mine(h.src) else h.into for h in hops if self.mine(h.dst)}

    def relay(self, steps: Sequence[Step], what: str, size: int) -> None:
        """Run steps where piece p of what a node sends at step s + 1 is ready once piece p of what
        it sent at step s was made and piece p of every hop into it at step s was seen by
        ``arrived`` (in and out hops of a node have one length; ``size``, the largest hop in
        bytes, the same on every rank, sets how many pieces). Every receive is posted up front,
        each piece is made the moment it is ready and sent at once, and pieces are waited for in
        (step, piece, hop) order, so a codec's work and the ring's additions overlap the wire.
        That cannot deadlock: a piece depends only on the same piece of earlier steps."""
        n, last = self.n_nodes, len(steps)
        k = self._pieces(size, last, max(s.unit for s in steps))
        ends: Dict[Tuple[int, int], Tuple[List[Hop], List[Hop]]] = {}   # (step, node) -> (hops in, hops out)
        for s, step in enumerate(steps):
            for hop in step.hops:
                self._meter(hop)
                for side, node in enumerate((hop.dst, hop.src)):
                    if self.mine(node):
                        ends.setdefault((s, node), ([], []))[side].append(hop)

        def post(send: bool, t: torch.Tensor, node: int, s: int, hop: Hop, p: int):
            return self._p2p(what, send, t, node, ((s * n + hop.src) * n + hop.dst) * k + p)

        recvs = [(s, p, hop, a, b, post(False, hop.into[a:b], hop.src, s, hop, p))
                 for s in range(last) for hop in sorted(steps[s].hops, key=lambda h: (h.src, h.dst))
                 if hop.into is not None for p, (a, b) in enumerate(pieces(hop.into.numel(), k, steps[s].unit))]
        recvs.sort(key=lambda r: r[:2])   # (step, piece), then hops in (src, dst) order
        sends, waiting = [], {}
        todo = collections.deque(itertools.product([0], self.nodes, range(k)))   # (step, node, piece) that may go

        def count(s: int, node: int, p: int) -> None:   # one of what piece p of node's step s + 1 waits for
            key = (s, node, p)
            waiting[key] = waiting.get(key, len(ends.get((s, node), ((), ()))[0]) + 1) - 1
            if waiting[key] == 0 and s + 1 < last:
                todo.append((s + 1, node, p))

        def arrive(s: int, hop: Hop, p: int, a: int, b: int, piece: torch.Tensor) -> None:
            if steps[s].arrived is not None:
                steps[s].arrived(hop, a, b, piece)
            count(s, hop.dst, p)

        def drain() -> None:   # make and send every piece that may go (a queue: no recursion, no cycle)
            while todo:
                s, node, p = todo.popleft()
                if steps[s].make is not None:
                    steps[s].make(node, p, k)
                for hop in ends.get((s, node), ((), ()))[1]:
                    a, b = pieces(hop.data.numel(), k, steps[s].unit)[p]
                    if self.mine(hop.dst):
                        arrive(s, hop, p, a, b, hop.data[a:b])
                    else:
                        sends.append((post(True, hop.data[a:b], hop.dst, s, hop, p), hop.dst))
                count(s, node, p)

        drain()
        for s, p, hop, a, b, work in recvs:   # each wait names the rank it waits for
            self._wait([work], f"{what} step {s} from rank {self._peer(hop.src)}" if last > 1
                       else f"{what} from rank {self._peer(hop.src)}")
            arrive(s, hop, p, a, b, hop.into[a:b])
            drain()
        for work, dst in sends:
            self._wait([work], f"{what} to rank {self._peer(dst)}")

    coded_bytes = 1 << 20   # the largest piece of a compressed message (and of the codec's scratch)

    def _pieces(self, size: int, n_steps: int, unit: int) -> int:
        """Pieces per hop in a relay of hops of at most ``size`` bytes: a compressed message
        (``unit`` > 1) in pieces of at most :attr:`coded_bytes`, so the codec works on a piece at
        a time; an fp32 one whole, unless the transport's wire wants more."""
        return 1 if unit == 1 else max(1, -(-size // self.coded_bytes))

    @abc.abstractmethod
    def _p2p(self, what: str, send: bool, tensor: torch.Tensor, node: int, tag: int):
        """Post an isend of ``tensor`` to (or an irecv into it from) the rank holding ``node``."""

    @abc.abstractmethod
    def _wait(self, works: Sequence, what: str) -> None:
        """Wait for posted messages, each bounded in time."""

    def _peer(self, node: int) -> int:
        """The rank that holds ``node``, as messages name it."""
        return self.owner[node]

    def byte_hop(self, src: int, dst: int, payload: Optional[torch.Tensor], size: int, like: torch.Tensor,
                 step: int = 0) -> Hop:
        """A hop of ``size`` bytes (``like``'s dtype and device: ``uint8``) at ``step`` of a relay,
        with a landing buffer (kept between calls) where it comes from another rank."""
        into = None
        if self.mine(dst) and not self.mine(src):
            into = self.buffer(("hop", step, src, dst), size, like)
        return Hop(src, dst, payload if self.mine(src) else None, into)

    def _meter(self, hop: Hop) -> None:
        """Count a hop where it touches this process: on the wire, or copied in memory (a hop
        between two of its nodes)."""
        if self.mine(hop.src) and self.mine(hop.dst):
            self._meter_copy(hop.src, hop.dst, hop.data.nbytes)
        elif self.mine(hop.src):
            self.meter.add(hop.src, "isend", sent=hop.data.nbytes, phase=CONSENSUS)
        elif self.mine(hop.dst):
            self.meter.add(hop.dst, "irecv", recv=hop.into.nbytes, phase=CONSENSUS)

    def _meter_copy(self, src: int, dst: int, size: int) -> None:
        self.meter.add(src, "copy", sent=size, phase=IN_PROCESS)
        self.meter.add(dst, "copy", recv=size, phase=IN_PROCESS)

    @abc.abstractmethod
    def _sum_ranks(self, total: torch.Tensor) -> None:
        """``total`` := its sum over every process (in place)."""

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(nodes), k] local rows -> [n_nodes, k] for every node, in node order: data that
        every rank needs (telemetry of the rounds, the collections' records), metered as
        ``telemetry``. Agreement between ranks does not come here (:mod:`admm_dist.engine.control`)."""
        if rows.dim() != 2 or rows.shape[0] != len(self.nodes):
            raise ValueError(f"gather_rows expects [{len(self.nodes)}, k] rows, got {tuple(rows.shape)}")
        for node in self.nodes:
            size = rows.shape[1] * rows.element_size() * (self.n_nodes - 1)
            self.meter.add(node, "all_gather", sent=size, recv=size, phase=TELEMETRY)
        return self._gather(rows)

    @abc.abstractmethod
    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, in rank order."""

    def barrier(self) -> None:
        """Wait for every node (a no-op in one process)."""

    def close(self) -> None:
        """Release buffers; the process group itself belongs to :mod:`admm_dist.engine.dist`."""
        self._scratch.clear()

    def buffer(self, key: object, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A scratch tensor kept between calls (``numel`` items like ``like``)."""
        s = self._scratch.get(key)
        if s is None or s.numel() < numel or s.dtype != like.dtype or s.device != like.device:
            s = self._scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return s[:numel]

    # -- consensus ------------------------------------------------------------------------
    def consensus_(self, vectors: Sequence[torch.Tensor]) -> None:
        """Replace each local node's vector in place (exact mean, or tau mixing steps)."""
        if len(vectors) != len(self.nodes):
            raise ValueError(f"consensus_ got {len(vectors)} vectors for {len(self.nodes)} local node(s)")
        for v in vectors:
            if v.dim() != 1 or not v.is_contiguous() or not v.is_floating_point():
                raise ValueError("consensus_ works on contiguous 1-D floating-point vectors "
                                 f"(got shape {tuple(v.shape)}, dtype {v.dtype}): flatten it first")
        if len({v.numel() for v in vectors}) > 1:
            raise ValueError("every node's vector must have the same length")
        if self.n_nodes == 1:
            return
        if self.compress != "none":
            compressed.consensus_(self, vectors)
        elif self.mode in MIXING:
            self._mix(vectors)
        elif self.mode == "ring":
            self._ring(vectors)
        else:
            self._coordinator(vectors)

    def _coordinator(self, vs: Sequence[torch.Tensor]) -> None:
        total = vs[0] if len(vs) == 1 else vs[0].clone()
        for v in vs[1:]:
            total.add_(v)
        for node, v in zip(self.nodes, vs):
            self.meter.add(node, "all_reduce", **self.ring_convention(v.numel(), node, v.element_size()))
        self._sum_ranks(total)
        total.div_(self.n_nodes)
        for v in vs:
            if v is not total:
                v.copy_(total)

    def _ring(self, vs: Sequence[torch.Tensor]) -> None:
        """Step s < n - 1 (reduce-scatter): node i hands chunk i - s to node i + 1, which adds it
        to its own (own + incoming; at the last of these steps node i holds chunk i + 1 summed
        and divides it by n). Step s >= n - 1 (all-gather): node i hands chunk i - s on as is.
        Elementwise, piece by piece: the same bits whatever the pieces and the placement."""
        n = self.n_nodes
        bounds = chunk_bounds(vs[0].numel(), n)
        here = dict(zip(self.nodes, vs))
        biggest = max(hi - lo for lo, hi in bounds)

        def step(s: int) -> Step:
            hops = []
            for i in [i for i in range(n) if self.mine(i) or self.mine((i + 1) % n)]:
                dst, (lo, hi) = (i + 1) % n, bounds[(i - s) % n]
                into = None   # from another rank: an inbox per step (reduce-scatter), in place (all-gather)
                if self.mine(dst) and not self.mine(i):
                    into = self.buffer(("ring", dst, s), biggest, vs[0])[:hi - lo] if s < n - 1 else here[dst][lo:hi]
                hops.append(Hop(i, dst, here[i][lo:hi] if self.mine(i) else None, into))

            def arrived(hop: Hop, a: int, b: int, piece: torch.Tensor) -> None:
                lo = bounds[(hop.src - s) % n][0]
                mine = here[hop.dst][lo + a:lo + b]
                if s < n - 1:
                    mine.add_(piece)
                    if s == n - 2:
                        mine.div_(n)
                elif hop.into is None:   # within this process (from another rank it landed in place)
                    mine.copy_(piece)
            return Step(hops, arrived)

        self.relay([step(s) for s in range(2 * n - 2)], "ring", biggest * vs[0].element_size())

    def _mix(self, vs: Sequence[torch.Tensor]) -> None:
        """``gossip_steps`` neighbour-mixing steps (one, for ``decentralized``)."""
        here = dict(zip(self.nodes, vs))
        p = vs[0].numel()
        for step in range(self.gossip_steps):
            hops = []
            for i in self.nodes:
                for j in self.neighbours[i]:
                    hops.append(Hop(i, j, here[i], None))      # i's vector goes to j
                    if not self.mine(j):                       # j's vector lands at i
                        hops.append(Hop(j, i, None, self.buffer(("inbox", j, i), p, vs[0])))
            got = self.exchange(hops, f"gossip step {step}")
            mixed = {}
            for i in self.nodes:   # W_ii v_i + sum_j W_ij v_j, neighbours in ascending order
                row = self.weights[i]
                mixed[i] = torch.mul(here[i], row[i], out=self.buffer(("mixed", i), p, vs[0]))
                for j in self.neighbours[i]:
                    mixed[i].add_(got[(j, i)], alpha=row[j])
            for i in self.nodes:
                here[i].copy_(mixed[i])
