"""Compressed consensus (``compress int8 | fp8 | int4 | bf16``): every payload is a node's *change*
against a public copy that sender and receivers keep bit-identical, so the error of the compressor
(:mod:`admm_dist.engine.codec`) vanishes as the iterates settle and ADMM reaches the
optimum itself, not a neighbourhood of it.

Written once as schedules of node-to-node messages over the transport's ``relay`` (in memory
between nodes of one process, on the wire between ranks), so the single-process oracle and
every placement run the same arithmetic and agree bit for bit. Each message is made (encoded)
and seen (decoded) a piece at a time, at codec blocks, while the next piece is on the wire;
block codes do not depend on where a message is cut, and every sum is taken in node order.

- **Mixing modes** (``gossip``, ``decentralized``): CHOCO-Gossip's public copies (Koloskova,
  Stich, Jaggi 2019). Node i keeps its public copy h_i and a copy of each neighbour's h_j.
  Per mixing step it sends q_i = Q(v_i - h_i) to its neighbours; sender and receivers add
  the decoded q_i to their copies of h_i; then v_i <- v_i + sum_j W_ij (h_j - h_i). With
  exact copies that is sum_j W_ij v_j, the uncompressed step. For ``decentralized`` the dual
  then moves by (1/2)(h_i - mean_j h_j): the increments of sum_i alpha_i cancel exactly, as
  node-based decentralized ADMM needs for its fixed point to be the optimum.
- **Exact-mean modes** (``coordinator``, ``ring``): a reduce-scatter to the chunk owners, then
  an all-gather, both compressed. Node i keeps h_i (its public copy) and sends chunk c of
  Q(v_i - h_i) to node c, which sums the decoded chunks in fp32 in node order, keeps the
  exact running mean H_c of the h's, and sends Q(H_c - zhat_c) to every node; every node adds
  it to its copy zhat, and z_i = zhat on every node, bit for bit. A value is quantized once
  on its way in and once on its way out, never per hop; a ring that re-quantizes partial sums
  at every hop piles up N - 1 quantization errors per chunk (docs/benchmarks.md measures both).

State (per node, checkpointed with the node: :meth:`Communicator.node_state`): ``hat.<j>``
for the mixing modes (j = the node and its neighbours: :class:`CompressedMixing`), ``h``,
``zhat`` and ``H`` (the node's own chunk) for the exact-mean modes (:class:`CompressedMean`).
It starts at zero. Each algorithm owns its state, its scratch and its codec.
"""
from __future__ import annotations

from typing import Sequence

import torch

from admm_dist.engine.codec import codec
from admm_dist.engine.comm.algorithm import Algorithm
from admm_dist.engine.comm.meter import chunk_bounds
from admm_dist.engine.comm.schedule import Hop, Step, Transport, pieces
from admm_dist.engine.comm.topology import Graph


class Compressed(Algorithm):
    """An algorithm whose payloads are codes of ``compress``, by a codec of its own
    (:class:`~admm_dist.engine.codec.Codec`)."""

    def __init__(self, graph: Graph, compress: str = "none") -> None:
        super().__init__(graph, compress)
        self.codec = codec(compress)


class CompressedMixing(Compressed):
    """CHOCO-Gossip's public copies: ``graph.steps`` mixing steps on changes against them."""

    def bytes_sent(self, numel: int, node: int, itemsize: int = 4) -> int:
        return self.graph.steps * len(self.graph.neighbours[node]) * self.codec.payload_bytes(numel)

    def consensus_(self, transport: Transport, vs: Sequence[torch.Tensor]) -> None:
        here, cod, (nbrs, weights, steps) = dict(zip(transport.nodes, vs)), self.codec, self.graph
        p, u8 = vs[0].numel(), vs[0].new_empty(0, dtype=torch.uint8)
        size = cod.payload_bytes(p)
        for step in range(steps):
            sent = {i: self.buffer(("q", i), size, u8) for i in transport.nodes}

            def make(i: int, q: int, k: int) -> None:   # piece q of Q(v_i - h_i); h_i moves by it
                a, b = pieces(p, k, cod.block)[q]
                cod.encode_(sent[i][cod.payload_bytes(a):cod.payload_bytes(b)], here[i][a:b],
                            self.slot(i, f"hat.{i}", p, vs[0])[a:b])

            def arrived(hop: Hop, a: int, b: int, piece: torch.Tensor) -> None:   # j's copy of h_i moved
                lo, hi = cod.values(a, b, p)
                cod.decode_(self.slot(hop.dst, f"hat.{hop.src}", p, vs[0])[lo:hi], piece, add=True)

            hops = [transport.byte_hop(i, j, sent.get(i), size, u8)
                    for i in range(self.n_nodes) for j in nbrs[i]]
            transport.relay([Step(hops, arrived, make, cod.block_bytes)], f"compressed mixing step {step}",
                            size)
            gap = self.buffer("gap", p, vs[0])
            for i in transport.nodes:   # v_i + sum_j W_ij (h_j - h_i): reads only public copies, so in place
                row, copies = weights[i], self._state[i]
                for j in nbrs[i]:
                    here[i].add_(torch.sub(copies[f"hat.{j}"], copies[f"hat.{i}"], out=gap), alpha=row[j])


class CompressedMean(Compressed):
    """The exact mean through the chunks' owner nodes, on changes against public copies."""

    def bytes_sent(self, numel: int, node: int, itemsize: int = 4) -> int:
        n, size = self.n_nodes, self.codec.payload_bytes
        sizes = [hi - lo for lo, hi in chunk_bounds(numel, n)]
        return sum(size(s) for k, s in enumerate(sizes) if k != node) + (n - 1) * size(sizes[node])

    def consensus_(self, transport: Transport, vs: Sequence[torch.Tensor]) -> None:
        """One relay of two steps: chunk k of each node's change to node k; node k's change of the
        mean to every node. Node k makes piece q of the second step once piece q of every node's
        chunk k has arrived, and decodes them in node order, so the sum's bits do not depend on the
        order in which they came."""
        n, cod, mine, slot = self.n_nodes, self.codec, transport.mine, self.slot
        p, u8 = vs[0].numel(), vs[0].new_empty(0, dtype=torch.uint8)
        f32 = vs[0].new_empty(0, dtype=torch.float32)
        bounds = chunk_bounds(p, n)
        here = dict(zip(transport.nodes, vs))
        sizes = [cod.payload_bytes(hi - lo) for lo, hi in bounds]
        ins = {i: [self.buffer(("in", i, k), sizes[k], u8) for k in range(n)] for i in transport.nodes}
        outs = {k: self.buffer(("out", k), sizes[k], u8) for k in transport.nodes}
        hops = [transport.byte_hop(i, k, ins[i][k] if mine(i) else None, sizes[k], u8)
                for i in range(n) for k in range(n) if k != i]
        got = {(h.src, h.dst): h.data if mine(h.src) else h.into for h in hops if mine(h.dst)}

        def cut(k: int, q: int, parts: int):   # piece q of chunk k: its values [a, b), its payload's bytes
            a, b = pieces(bounds[k][1] - bounds[k][0], parts, cod.block)[q]
            return a, b, slice(cod.payload_bytes(a), cod.payload_bytes(b))

        def make_in(i: int, q: int, parts: int) -> None:   # piece q of every chunk of Q(v_i - h_i)
            h = slot(i, "h", p, vs[0])
            for k, (lo, _) in enumerate(bounds):
                a, b, at = cut(k, q, parts)
                cod.encode_(ins[i][k][at], here[i][lo + a:lo + b], h[lo + a:lo + b])

        def make_out(k: int, q: int, parts: int) -> None:   # owner k: the mean's piece q, then its change
            lo, hi = bounds[k]
            a, b, at = cut(k, q, parts)
            total = self.buffer(("total", k), b - a, f32).zero_()   # kept between pieces and calls
            for i in range(n):
                cod.decode_(total, (ins[k][k] if i == k else got[(i, k)])[at], add=True)
            mean = slot(k, "H", hi - lo, vs[0])[a:b]
            mean.add_(total.div_(n))
            cod.encode_(outs[k][at], mean, slot(k, "zhat", p, vs[0])[lo + a:lo + b])

        def arrived(hop: Hop, a: int, b: int, piece: torch.Tensor) -> None:   # node j's zhat moves
            lo, hi = bounds[hop.src]
            va, vb = cod.values(a, b, hi - lo)
            cod.decode_(slot(hop.dst, "zhat", p, vs[0])[lo + va:lo + vb], piece, add=True)

        back = [transport.byte_hop(k, j, outs.get(k), sizes[k], u8, step=1)
                for k in range(n) for j in range(n) if j != k]
        transport.relay([Step(hops, None, make_in, cod.block_bytes),
                         Step(back, arrived, make_out, cod.block_bytes)], "compressed mean", max(sizes))
        for j in transport.nodes:
            here[j].copy_(slot(j, "zhat", p, vs[0]))
