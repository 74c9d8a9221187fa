"""The communicator the ADMM engine talks to: a transport, and the consensus algorithm it runs.

A communicator owns a set of *nodes* (training seats): a block of them per rank under torchrun,
all of them in one process otherwise; the engine hands it one flat vector per node and never
sees ranks. ``consensus_`` replaces each v_i in place: ``coordinator`` by the exact mean (each
process sums its nodes in node order, one sum over the ranks, then / N); ``ring`` by the exact
mean as a chunked ring all-reduce; ``gossip`` by ``tau`` Metropolis mixing steps;
``decentralized`` by one step of v_i <- (v_i + mean_{j in N_i} v_j) / 2 (fed x:
:mod:`admm_dist.engine.admm`); with ``compress``, by their compressed variants (:mod:`~.compressed`).

The algorithm is an object of its own (:mod:`~.algorithm`), picked once from (mode, compress)
in :data:`ALGORITHMS`; it owns its per-node state (checkpointed: :meth:`Communicator.node_state`),
its scratch and its codec. The communicator keeps what is the transport's: where the nodes live,
the moves of messages, the landing buffers of hops from other ranks, and the meter.

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
from typing import Dict, List, Optional, Sequence, Tuple, Type

import torch

from admm_dist.core.errors import RunError, UserError
from admm_dist.engine.codec import check_compress
from admm_dist.engine.comm.algorithm import Algorithm
from admm_dist.engine.comm.compressed import CompressedMean, CompressedMixing
from admm_dist.engine.comm.exact import AllReduceMean, RingMean
from admm_dist.engine.comm.meter import CONSENSUS, IN_PROCESS, TELEMETRY, ByteMeter, ring_bytes_per_rank
from admm_dist.engine.comm.mixing import Mixing
from admm_dist.engine.comm.schedule import Hop, Step, pieces
from admm_dist.engine.comm.topology import MIXING, check_mode, graph

# The consensus algorithm of each (mode, compressed?): the one place a communicator picks it.
ALGORITHMS: Dict[Tuple[str, bool], Type[Algorithm]] = {
    ("coordinator", False): AllReduceMean, ("ring", False): RingMean,
    ("gossip", False): Mixing, ("decentralized", False): Mixing,
    ("coordinator", True): CompressedMean, ("ring", True): CompressedMean,
    ("gossip", True): CompressedMixing, ("decentralized", True): CompressedMixing,
}


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
    """Exchanges flat vectors between the N nodes of one ADMM problem by its algorithm
    (:attr:`algorithm`); the subclasses are the transports (:class:`~.local.LocalCommunicator`,
    :class:`~.process_group.ProcessGroupCommunicator`)."""

    def __init__(self, *, mode: str, n_nodes: int, blocks: Sequence[range], rank: int,
                 topology: str = "ring", gossip_steps: int = 1, meter: Optional[ByteMeter] = None,
                 compress: str = "none") -> None:
        check_mode(mode, topology, gossip_steps)
        if n_nodes < 1:
            raise UserError(f"n_nodes={n_nodes}: a consensus problem needs at least one node")
        self.compress = check_compress(compress)
        self.mode = mode
        self.n_nodes = int(n_nodes)
        self.blocks, self.rank = list(blocks), rank   # the nodes of each rank, in rank order; this rank
        self.owner = [r for r, block in enumerate(self.blocks) for _ in block]   # the rank of each node
        self.nodes: Tuple[int, ...] = tuple(self.blocks[rank])
        self.topology = topology
        self.gossip_steps = int(gossip_steps)
        self.meter = meter if meter is not None else ByteMeter()
        self.graph = graph(mode, topology, self.n_nodes, self.gossip_steps)
        self.neighbours: List[List[int]] = self.graph.neighbours
        self.weights = self.graph.weights
        self.algorithm: Algorithm = ALGORITHMS[(mode, compress != "none")](self.graph, compress)
        self._landing: Dict[object, torch.Tensor] = {}   # where hops from other ranks land

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
        return 0 if self.n_nodes == 1 else self.algorithm.bytes_sent(numel, node, itemsize)

    def ring_convention(self, numel: int, node: int, itemsize: int = 4) -> dict:
        """What a ring all-reduce would send from ``node`` and deliver to it (from its left)."""
        n = self.n_nodes
        return {"sent": ring_bytes_per_rank(numel, n, node, itemsize),
                "recv": ring_bytes_per_rank(numel, n, (node - 1) % n, itemsize)}

    # -- the algorithm's per-node state (checkpointed with the node) ---------------------------
    def node_state(self, node: int) -> Dict[str, torch.Tensor]:
        """What the algorithm keeps of ``node`` between calls (compressed consensus: its public
        copies, ``hat.<j>`` or ``h``, ``zhat``, ``H``); empty for fp32 consensus."""
        return self.algorithm.state(node)

    def load_node_state(self, node: int, tensors: Dict[str, torch.Tensor]) -> None:
        self.algorithm.load_state(node, tensors)

    # -- the transport --------------------------------------------------------------------
    def exchange(self, hops: Sequence[Hop], what: str) -> Dict[Tuple[int, int], torch.Tensor]:
        """Move the hops that touch this process (a relay of one step; every hop of one length).
        Returns, per hop into one of its nodes, keyed (src, dst), the sender's own tensor (no copy)
        or ``into``."""
        size = max((t.nbytes for h in hops for t in (h.data, h.into) if t is not None), default=0)
        self.relay([Step(hops)], what, size)
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
                 if hop.into is not None
                 for p, (a, b) in enumerate(pieces(hop.into.numel(), k, steps[s].unit))]
        recvs.sort(key=lambda r: r[:2])   # (step, piece), then hops in (src, dst) order
        sends, waiting = [], {}
        todo = collections.deque(itertools.product([0], self.nodes, range(k)))   # (step, node, piece) to go

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
            into = self.landing(("hop", step, src, dst), size, like)
        return Hop(src, dst, payload if self.mine(src) else None, into)

    def landing(self, key: object, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer kept between calls (``numel`` items like ``like``) where a hop from another
        rank lands."""
        s = self._landing.get(key)
        if s is None or s.numel() < numel or s.dtype != like.dtype or s.device != like.device:
            s = self._landing[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return s[:numel]

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

    def all_reduce_(self, total: torch.Tensor) -> None:
        """``total`` := its sum over every process, one all_reduce (metered for each node here
        by the ring convention)."""
        for node in self.nodes:
            sizes = self.ring_convention(total.numel(), node, total.element_size())
            self.meter.add(node, "all_reduce", **sizes)
        self._sum_ranks(total)

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
        """Release buffers (the algorithm's state stays); the process group itself belongs to
        :mod:`admm_dist.engine.dist`."""
        self._landing.clear()
        self.algorithm.close()

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
        if self.n_nodes > 1:
            self.algorithm.consensus_(self, vectors)
