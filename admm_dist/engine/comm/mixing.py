"""Neighbour mixing in fp32 (``gossip``, ``decentralized``): ``steps`` mixing steps
v_i <- W_ii v_i + sum_{j in N_i} W_ij v_j over the graph (Metropolis weights for ``gossip``,
the half mean for ``decentralized``: :mod:`~.topology`); each node keeps its own result.
"""
from __future__ import annotations

from typing import Sequence

import torch

from admm_dist.engine.comm.algorithm import Algorithm
from admm_dist.engine.comm.schedule import Hop, Transport


class Mixing(Algorithm):
    """``graph.steps`` exchanges of the whole vector with every neighbour, each then mixed."""

    def bytes_sent(self, numel: int, node: int, itemsize: int = 4) -> int:
        return self.graph.steps * len(self.graph.neighbours[node]) * numel * itemsize

    def consensus_(self, transport: Transport, vs: Sequence[torch.Tensor]) -> None:
        here, (nbrs, weights, steps) = dict(zip(transport.nodes, vs)), self.graph
        p = vs[0].numel()
        for step in range(steps):
            hops = []
            for i in transport.nodes:
                for j in nbrs[i]:
                    hops.append(Hop(i, j, here[i], None))      # i's vector goes to j
                    if not transport.mine(j):                  # j's vector lands at i
                        hops.append(Hop(j, i, None, transport.landing(("inbox", j, i), p, vs[0])))
            got = transport.exchange(hops, f"gossip step {step}")
            mixed = {}
            for i in transport.nodes:   # W_ii v_i + sum_j W_ij v_j, neighbours in ascending order
                row = weights[i]
                mixed[i] = torch.mul(here[i], row[i], out=self.buffer(("mixed", i), p, vs[0]))
                for j in nbrs[i]:
                    mixed[i].add_(got[(j, i)], alpha=row[j])
            for i in transport.nodes:
                here[i].copy_(mixed[i])
