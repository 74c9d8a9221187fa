"""The exact mean in fp32 (``coordinator``, ``ring``): every node ends with the mean of all N.

- :class:`AllReduceMean` (``coordinator``): each process sums its nodes in node order, one
  all_reduce sums over the ranks (in the backend's order), then / N.
- :class:`RingMean` (``ring``): a chunked ring all-reduce written as node-to-node hops, so its
  sums are in our order and every placement gets the oracle's bits.

Both send what a ring all-reduce sends (:func:`~.meter.ring_bytes_per_rank`) and keep no state.
"""
from __future__ import annotations

from typing import Sequence

import torch

from admm_dist.engine.comm.algorithm import Algorithm
from admm_dist.engine.comm.meter import chunk_bounds, ring_bytes_per_rank
from admm_dist.engine.comm.schedule import Hop, Step, Transport


class ExactMean(Algorithm):
    """The exact mean, at the bytes of a ring all-reduce."""

    def bytes_sent(self, numel: int, node: int, itemsize: int = 4) -> int:
        return ring_bytes_per_rank(numel, self.n_nodes, node, itemsize)


class AllReduceMean(ExactMean):
    """One sum over the ranks of each process's own sum."""

    def consensus_(self, transport: Transport, vs: Sequence[torch.Tensor]) -> None:
        total = vs[0] if len(vs) == 1 else vs[0].clone()
        for v in vs[1:]:
            total.add_(v)
        transport.all_reduce_(total)
        total.div_(self.n_nodes)
        for v in vs:
            if v is not total:
                v.copy_(total)


class RingMean(ExactMean):
    """Step s < n - 1 (reduce-scatter): node i hands chunk i - s to node i + 1, which adds it
    to its own (own + incoming; at the last of these steps node i holds chunk i + 1 summed
    and divides it by n). Step s >= n - 1 (all-gather): node i hands chunk i - s on as is.
    Elementwise, piece by piece: the same bits whatever the pieces and the placement."""

    def consensus_(self, transport: Transport, vs: Sequence[torch.Tensor]) -> None:
        n, mine = self.n_nodes, transport.mine
        bounds = chunk_bounds(vs[0].numel(), n)
        here = dict(zip(transport.nodes, vs))
        biggest = max(hi - lo for lo, hi in bounds)

        def step(s: int) -> Step:
            hops = []
            for i in [i for i in range(n) if mine(i) or mine((i + 1) % n)]:
                dst, (lo, hi) = (i + 1) % n, bounds[(i - s) % n]
                into = None   # from another rank: an inbox per step (reduce-scatter), in place (all-gather)
                if mine(dst) and not mine(i):
                    into = (transport.landing(("ring", dst, s), biggest, vs[0])[:hi - lo] if s < n - 1
                            else here[dst][lo:hi])
                hops.append(Hop(i, dst, here[i][lo:hi] if mine(i) else None, into))

            def arrived(hop: Hop, a: int, b: int, piece: torch.Tensor) -> None:
                lo = bounds[(hop.src - s) % n][0]
                own = here[hop.dst][lo + a:lo + b]
                if s < n - 1:
                    own.add_(piece)
                    if s == n - 2:
                        own.div_(n)
                elif hop.into is None:   # within this process (from another rank it landed in place)
                    own.copy_(piece)
            return Step(hops, arrived)

        transport.relay([step(s) for s in range(2 * n - 2)], "ring", biggest * vs[0].element_size())
