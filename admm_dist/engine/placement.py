"""Which rank owns which ADMM node: N nodes on W ranks.

W <= N: rank r owns nodes ``blocks(N, W)[r]``; the first ``N mod W`` ranks own one node more
than the others, so block sizes differ by at most one. W = N is one node per rank, W = 1 is
every node in one process.

W = k x N: each node (seat) has a *seat group* of k ranks, contiguous (ranks s k .. s k + k - 1
hold seat s), so a group is on one host whenever torchrun's ``nproc_per_node`` is a multiple of
k. The group's first rank, its *leader*, takes part in the consensus among seats; the others
compute their share of the seat's x-steps (:class:`Placement`).

Placement never changes the numbers: every communicator computes each node's result with the
single-process oracle's arithmetic in the oracle's order, so a node's x, z and u do not depend
on where it lives (bit for bit for ring and gossip).
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence

from admm_dist.core.errors import UserError


def even_split(n_items: int, parts: int) -> List[range]:
    """``n_items`` cut into ``parts`` contiguous ranges of near-equal size, in order: the first
    ``n_items mod parts`` one longer (empty ones when there are fewer items than parts). The one
    rule for nodes over ranks, chunks of a vector over nodes and micro-batches over parts."""
    base, extra = divmod(n_items, parts)
    out, start = [], 0
    for r in range(parts):
        size = base + (1 if r < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def blocks(n_nodes: int, world: int) -> List[range]:
    """The contiguous node block of each rank, in rank order."""
    if world < 1:
        raise UserError(f"world size {world}: a run needs at least one rank")
    if world > n_nodes:
        raise UserError(f"world size {world} > number of nodes {n_nodes}: these ranks hold blocks of "
                        f"nodes, so launch at most {n_nodes} rank(s) (torchrun --nproc_per_node {n_nodes}, "
                        "or fewer: several nodes then share a rank); the trainer also takes k ranks per node")
    return even_split(n_nodes, world)


def owners(n_nodes: int, world: int) -> List[int]:
    """The rank owning each node, in node order."""
    return [r for r, block in enumerate(blocks(n_nodes, world)) for _ in block]


def valid_worlds(n_nodes: int, world: int) -> List[int]:
    """The valid world sizes nearest ``world`` for ``n_nodes`` seats: at most N, or a multiple of N."""
    below = n_nodes * (world // n_nodes) if world > n_nodes else world
    return sorted({below, n_nodes * -(-world // n_nodes)})


@dataclasses.dataclass(frozen=True)
class Placement:
    """N nodes on W ranks: blocks of nodes per rank (W <= N), or a seat group of k ranks per node
    (W = k N); any other W is refused in one line that names the nearest valid ones."""
    n_nodes: int
    world: int

    def __post_init__(self) -> None:
        if self.world > self.n_nodes and self.world % self.n_nodes:
            lo, hi = valid_worlds(self.n_nodes, self.world)
            raise UserError(f"world size {self.world} for {self.n_nodes} seats: launch {lo} or {hi} ranks "
                            f"(at most one rank per seat, or the same number k of ranks for every seat: "
                            f"W = k x {self.n_nodes})")
        blocks(self.n_nodes, min(self.world, self.n_nodes))   # W < 1 and N < 1 are refused there

    @property
    def k(self) -> int:
        """Ranks per seat: 1 when W <= N."""
        return max(1, self.world // self.n_nodes)

    def rank_blocks(self) -> List[range]:
        """The nodes each rank holds, in rank order (a seat group's ranks hold its one node)."""
        if self.k == 1:
            return blocks(self.n_nodes, self.world)
        return [range(r // self.k, r // self.k + 1) for r in range(self.world)]

    def seat_group(self, rank: int) -> range:
        """The ranks of ``rank``'s seat group (itself alone when k = 1)."""
        first = rank - rank % self.k
        return range(first, first + self.k)

    @property
    def leaders(self) -> List[int]:
        """The first rank of each seat group: the ranks that run the consensus among seats."""
        return list(range(0, self.world, self.k))

    def describe(self) -> str:
        """One line: seat -> ranks (or rank -> seats)."""
        if self.k == 1:
            return "; ".join(f"rank {r}: seats {b.start}-{b.stop - 1}" if len(b) > 1
                             else f"rank {r}: seat {b.start}"
                             for r, b in enumerate(self.rank_blocks()))
        return "; ".join(f"seat {s}: ranks {s * self.k}-{s * self.k + self.k - 1}"
                         for s in range(self.n_nodes))

    def backbone(self, size: int, held: Sequence[float], sharded: bool) -> str:
        """What each rank holds of a frozen backbone of ``size`` bytes (``held``: every rank's
        bytes of it, measured), in words."""
        head = f"backbone ({size / 2 ** 20:.1f} MiB): "
        if not (sharded and self.k > 1):
            return head + "whole on every rank" + (
                f" ({self.k} ranks per seat; shard_backbone=true holds 1/{self.k} each)"
                if self.k > 1 else "")
        parts = sorted({f"{b / size:.2f}" for b in held})
        return (head + f"sharded over the {self.k} ranks of each seat, each rank holding "
                f"{parts[0] if len(parts) == 1 else parts[0] + ' to ' + parts[-1]} of it")
