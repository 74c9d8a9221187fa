"""The communicator the ADMM engine talks to: every consensus algorithm, written once.

A communicator owns a set of *nodes* (training seats): a block of them per rank under torchrun,
all of them in one process otherwise. The engine hands it one flat vector per node it owns and
never sees ranks. ``consensus_`` replaces each v_i in place: ``coordinator`` by the exact mean
(each process sums its nodes in node order, one sum over the ranks, then / N); ``ring`` by the
exact mean as a chunked ring all-reduce (chunk c starts at node c, each partial sum is ``own +
incoming``); ``gossip`` by ``tau`` Metropolis mixing steps; ``decentralized`` by one step of
v_i <- (v_i + mean_{j in N_i} v_j) / 2 (the engine feeds it x: :mod:`admm_dist.engine.admm`);
with ``compress``, by their compressed variants (:mod:`~.compressed`).

Each algorithm is one schedule of node-to-node messages (:class:`Hop`) over all N nodes. The
transport, :meth:`Communicator.exchange`, moves the hops that touch this process: in memory
between two of its nodes, ``send``/``recv`` between ranks. The single-process oracle runs the same
code with every node in one block, so a node's result does not depend on where it lives, bit for
bit (but the coordinator's sum over ranks, whose order is the backend's). Bytes are counted once,
in the transport: ``consensus`` on the wire, ``in_process`` copied in memory (the oracle counts
every hop as the wire bytes of an N-rank run).
"""
from __future__ import annotations

import abc
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from admm_dist.core.errors import RunError, UserError
from admm_dist.engine.comm import compressed
from admm_dist.engine.comm.compress import check_compress
from admm_dist.engine.comm.meter import IN_PROCESS, TELEMETRY, ByteMeter, chunk_bounds, ring_bytes_per_rank
from admm_dist.engine.comm.topology import (DECENTRALIZED, MIXING, check_mode, half_mean_weights,
                                             metropolis_weights, neighbours)


class CommError(RunError):
    """A communication step failed (a peer died, timed out, or disagreed)."""


def first_line(e: BaseException) -> str:
    """A backend's error as one short line (gloo and NCCL raise long multi-line texts)."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


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


class Hop(NamedTuple):
    """One message of a schedule: node ``src`` hands ``data`` to node ``dst``."""
    src: int
    dst: int
    data: Optional[torch.Tensor]   # the payload, where ``src`` lives (None elsewhere)
    into: Optional[torch.Tensor]   # where it lands, where ``dst`` lives and ``src`` does not


# called for each piece [a, b) of a hop's payload as it arrives at one of this process's nodes
Arrived = Callable[[Hop, int, int, torch.Tensor], None]


class Communicator(abc.ABC):
    """Exchanges flat vectors between the N nodes of one ADMM problem; the subclasses are the
    transports (:class:`~.local.LocalCommunicator`, :class:`~.process_group.ProcessGroupCommunicator`)."""

    def __init__(self, *, mode: str, n_nodes: int, nodes: Sequence[int], topology: str = "ring",
                 gossip_steps: int = 1, meter: Optional[ByteMeter] = None, compress: str = "none") -> None:
        check_mode(mode, topology, gossip_steps)
        if n_nodes < 1:
            raise UserError(f"n_nodes={n_nodes}: a consensus problem needs at least one node")
        self.compress = check_compress(compress)
        # per node: the public copies of compressed consensus (admm_dist.engine.comm.compressed)
        self.compress_state: Dict[int, Dict[str, torch.Tensor]] = {}
        self.mode = mode
        self.n_nodes = int(n_nodes)
        self.nodes: Tuple[int, ...] = tuple(nodes)
        self.topology = topology
        self.gossip_steps = int(gossip_steps)
        self.meter = meter if meter is not None else ByteMeter()
        self.neighbours: List[List[int]] = neighbours(topology, self.n_nodes)
        self.weights = (half_mean_weights(self.neighbours) if mode == DECENTRALIZED
                        else metropolis_weights(self.neighbours))
        self._scratch: Dict[object, torch.Tensor] = {}

    # -- placement ------------------------------------------------------------------------
    @abc.abstractmethod
    def rank_blocks(self) -> List[range]:
        """The nodes of each rank, in rank order."""

    def mine(self, node: int) -> bool:
        """Whether ``node`` lives in this process."""
        return node in self.nodes

    @property
    def exact(self) -> bool:
        """True when consensus_ returns the exact mean (every z_i is one point z)."""
        return self.mode not in MIXING or self.n_nodes == 1

    def degree(self, node: int) -> int:
        return len(self.neighbours[node])

    def penalty_scale(self, node: int) -> float:
        """rho_i / rho for ``node``'s x-step: 1, but d_i / mean degree under ``decentralized``.

        Node-based decentralized ADMM (Shi et al. 2014) has one constant c and gives node i the
        proximal weight 2 c d_i; c = rho / (2 * mean degree) makes the mean weight rho, so a
        setting of rho couples as strongly as in the other modes (exactly rho on every node of
        a regular graph: ring, complete, expander for a power of two)."""
        if self.mode != DECENTRALIZED or self.n_nodes == 1:
            return 1.0
        mean_degree = sum(len(n) for n in self.neighbours) / self.n_nodes
        return self.degree(node) / mean_degree

    # -- bytes ------------------------------------------------------------------------------
    def analytic_bytes(self, numel: int, node: int, itemsize: int = 4) -> int:
        """Bytes ``node`` sends in one consensus_ of ``numel`` items (ring convention for all_reduce)."""
        if self.n_nodes == 1:
            return 0
        if self.compress != "none":
            return compressed.bytes_sent(self, numel, node)
        if self.mode in MIXING:
            return self.gossip_steps * self.degree(node) * numel * itemsize
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
    def exchange(self, hops: Sequence[Hop], what: str,
                 arrived: Optional[Arrived] = None) -> Dict[Tuple[int, int], torch.Tensor]:
        """Move every hop that touches this process; returns, per hop that arrived at one of its
        nodes, the tensor holding the payload, keyed (src, dst): the sender's own tensor for a
        hop within this process (no copy), ``into`` for one from another rank. ``arrived`` sees
        each piece as it lands (a hop within this process in one piece, at once); a receiver
        that works piece by piece is sent large payloads in pieces."""
        got: Dict[Tuple[int, int], torch.Tensor] = {}
        remote = []
        for hop in hops:
            if self.mine(hop.src) and self.mine(hop.dst):
                self._meter_copy(hop.src, hop.dst, hop.data.nbytes)
                got[(hop.src, hop.dst)] = hop.data
                if arrived is not None:
                    arrived(hop, 0, hop.data.numel(), hop.data)
            elif self.mine(hop.src) or self.mine(hop.dst):
                remote.append(hop)
        if remote:
            self._send_recv(sorted(remote, key=lambda h: (h.src, h.dst)), what, got, arrived)
        return got

    def byte_hop(self, src: int, dst: int, payload: Optional[torch.Tensor], size: int, device) -> Hop:
        """A hop of ``size`` bytes (``uint8``), with a landing buffer where it comes from another rank."""
        into = None
        if self.mine(dst) and not self.mine(src):
            into = torch.empty(size, dtype=torch.uint8, device=device)
        return Hop(src, dst, payload if self.mine(src) else None, into)

    def _meter_copy(self, src: int, dst: int, size: int) -> None:
        """A hop between two nodes of this process: bytes copied in memory, not on any wire."""
        self.meter.add(src, "copy", sent=size, phase=IN_PROCESS)
        self.meter.add(dst, "copy", recv=size, phase=IN_PROCESS)

    @abc.abstractmethod
    def _send_recv(self, hops: Sequence[Hop], what: str, got: Dict[Tuple[int, int], torch.Tensor],
                   arrived: Optional[Arrived]) -> None:
        """The hops between this process and another, in (src, dst) order: send and receive them."""

    @abc.abstractmethod
    def _sum_ranks(self, total: torch.Tensor) -> None:
        """``total`` := its sum over every process (in place)."""

    @abc.abstractmethod
    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(nodes), k] local rows -> [n_nodes, k] for every node, in node order: data that
        every rank needs (telemetry of the rounds, the collections' records), metered as
        ``telemetry``. Agreement between ranks does not come here (:mod:`admm_dist.engine.control`)."""

    def barrier(self) -> None:
        """Wait for every node (a no-op in one process)."""

    def close(self) -> None:
        """Release buffers; the process group itself belongs to :mod:`admm_dist.engine.dist`."""
        self._scratch.clear()

    def _meter_gather(self, row_bytes: int) -> None:
        for node in self.nodes:
            self.meter.add(node, "all_gather", sent=row_bytes * (self.n_nodes - 1),
                           recv=row_bytes * (self.n_nodes - 1), phase=TELEMETRY)

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
        n = self.n_nodes
        bounds = chunk_bounds(vs[0].numel(), n)
        here = dict(zip(self.nodes, vs))
        biggest = max(hi - lo for lo, hi in bounds)   # a node's inbox: one chunk from another rank

        def step(chunk: Callable[[int], int], landing: Callable[[int, int, int], torch.Tensor]) -> List[Hop]:
            """Node i hands chunk ``chunk(i)`` to node i + 1 (the hops touching this process)."""
            hops = []
            for i in range(n):
                dst = (i + 1) % n
                if self.mine(i) or self.mine(dst):
                    lo, hi = bounds[chunk(i) % n]
                    hops.append(Hop(i, dst, here[i][lo:hi] if self.mine(i) else None,
                                    landing(dst, lo, hi) if self.mine(dst) and not self.mine(i) else None))
            return hops

        # Reduce-scatter, step s: node i hands chunk i - s to node i + 1, which adds it to its own,
        # piece by piece as the pieces land (elementwise: the same bits, overlapped with the wire).
        for s in range(n - 1):
            def add(hop: Hop, a: int, b: int, piece: torch.Tensor, s=s) -> None:
                lo = bounds[(hop.src - s) % n][0]
                here[hop.dst][lo + a:lo + b].add_(piece)   # own + incoming
            self.exchange(step(lambda i, s=s: i - s, lambda dst, lo, hi: self.buffer(("ring", dst), biggest, vs[0])[:hi - lo]),
                          f"ring reduce-scatter step {s}", add)
        for node in self.nodes:   # node i now holds chunk i + 1 summed over every node
            lo, hi = bounds[(node + 1) % n]
            here[node][lo:hi].div_(n)
        # All-gather, step s: node i hands chunk i + 1 - s to node i + 1, which takes it as is
        # (received in place from another rank, copied within this process).
        for s in range(n - 1):
            hops = step(lambda i, s=s: i + 1 - s, lambda dst, lo, hi: here[dst][lo:hi])
            got = self.exchange(hops, f"ring all-gather step {s}")
            for hop in hops:
                if self.mine(hop.src) and self.mine(hop.dst):
                    lo, hi = bounds[(hop.src + 1 - s) % n]
                    here[hop.dst][lo:hi].copy_(got[(hop.src, hop.dst)])

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
