"""Which rank owns which ADMM node: N nodes on W <= N ranks, in contiguous blocks.

Rank r owns nodes ``blocks(N, W)[r]``; the first ``N mod W`` ranks own one node more than the
others, so block sizes differ by at most one. W = N is one node per rank, W = 1 is every node in
one process. Placement never changes the numbers: every communicator computes each node's
result with the single-process oracle's arithmetic in the oracle's order, so a node's x, z and
u do not depend on where it lives (bit for bit for ring and gossip).
"""
from __future__ import annotations

from typing import List

from admm_dist.core.errors import UserError


def blocks(n_nodes: int, world: int) -> List[range]:
    """The contiguous node block of each rank, in rank order."""
    if world < 1:
        raise UserError(f"world size {world}: a run needs at least one rank")
    if world > n_nodes:
        raise UserError(f"world size {world} > number of nodes {n_nodes}: a node cannot be split over "
                        f"ranks; launch at most {n_nodes} rank(s) (torchrun --nproc_per_node "
                        f"{n_nodes}, or fewer: several nodes then share a rank)")
    base, extra = divmod(n_nodes, world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def owners(n_nodes: int, world: int) -> List[int]:
    """The rank owning each node, in node order."""
    return [r for r, block in enumerate(blocks(n_nodes, world)) for _ in block]
