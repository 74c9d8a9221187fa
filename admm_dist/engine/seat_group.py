"""A seat group: the k ranks that share one seat's x-steps (W = k x N, :mod:`~.placement`).

A local Adam step's minibatch is cut into ``micro_batches`` parts in a fixed order; rank j of
the group computes parts ``my_parts(M)`` (a contiguous run of M / k of them), and
:meth:`SeatGroup.ordered_sum` gives every rank of the group the sum of every part's row (its
gradient and loss, say) in part order 0, 1, ..., M - 1. Each part is computed the same way
whichever rank computes it, and the sum is always taken in the same order, so the step is
bit-identical for every k, k = 1 (one rank computing every part) included. On GPU the same
holds where the kernels are deterministic (``torch.use_deterministic_algorithms``).

The group's first rank, its *leader*, carries the consensus between seats; :meth:`broadcast`
then gives the leader's results (z, u, the round's telemetry) to the rest of its group, so
every rank of a seat holds the same state. The group of one rank (k = 1) is this object with no
process group: nothing is sent.
"""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from admm_dist.core.errors import UserError
from admm_dist.engine.comm.communicator import wait_all
from admm_dist.engine.placement import even_split

if TYPE_CHECKING:
    from admm_dist.engine.comm.meter import ByteMeter

SEAT = "seat_group"   # the meter's phase of what a leader gives the rest of its seat group


def parts(items: Sequence[int], m: int) -> list:
    """``items`` cut into ``m`` contiguous parts of near-equal size (the first ``len % m`` one longer)."""
    if not 1 <= m <= len(items):
        raise UserError(f"micro_batches={m} for a minibatch of {len(items)}: set micro_batches "
                        f"between 1 and batch_size ({len(items)})")
    return [list(items[r.start:r.stop]) for r in even_split(len(items), m)]


def check_micro_batches(micro_batches: int, k: int) -> None:
    """Refuse M parts that k ranks per seat cannot share evenly, naming the fix."""
    if micro_batches % k:
        raise UserError(f"micro_batches={micro_batches} with {k} ranks per seat: set micro_batches "
                        f"to a multiple of {k} (the numbers are then the same at any world size)")


class SeatGroup:
    """Rank ``index`` of the ``k`` ranks of one seat, over ``group`` (None when k = 1)."""

    def __init__(self, k: int = 1, index: int = 0, group: Optional[dist.ProcessGroup] = None,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=600), leader: int = 0) -> None:
        if k > 1 and group is None:
            raise ValueError("a seat group of k > 1 ranks needs its process group")
        self.k, self.index, self.group, self.timeout = int(k), int(index), group, timeout
        self.leader = leader   # the global rank of the group's first rank

    @property
    def leads(self) -> bool:
        """Whether this rank carries the seat's part of the consensus (always, when k = 1)."""
        return self.index == 0

    def broadcast(self, tensors: Sequence[torch.Tensor], meter: Optional["ByteMeter"] = None,
                  node: int = 0) -> None:
        """Each tensor := the leader's, on every rank of the group (nothing to do when k = 1)."""
        if self.k == 1:
            return
        works = [dist.broadcast(t, src=self.leader, group=self.group, async_op=True) for t in tensors]
        wait_all(works, self.timeout, "the seat group's broadcast of the leader's results", dist.get_rank())
        if meter is not None:
            size = sum(t.nbytes for t in tensors)
            meter.add(node, "broadcast", sent=size * (self.k - 1) if self.leads else 0,
                      recv=0 if self.leads else size, phase=SEAT)

    def check(self, micro_batches: int) -> None:
        """Every rank of the group computes the same number of parts: k divides M."""
        check_micro_batches(micro_batches, self.k)

    def my_parts(self, micro_batches: int) -> range:
        """The parts this rank computes."""
        self.check(micro_batches)
        per = micro_batches // self.k
        return range(self.index * per, self.index * per + per)

    def gather(self, row: torch.Tensor, what: str = "the seat group's gather") -> torch.Tensor:
        """Every rank's ``row`` (one shape on every rank), stacked in group order: [k, ...]."""
        if self.k == 1:
            return row.unsqueeze(0)
        every = [torch.empty_like(row) for _ in range(self.k)]
        wait_all([dist.all_gather(every, row.contiguous(), group=self.group, async_op=True)],
                 self.timeout, what, dist.get_rank())
        return torch.stack(every)

    def ordered_sum(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows ([M / k, width], one per part of :meth:`my_parts`) -> the sum of every
        part's row in part order, on every rank of the group."""
        if self.k > 1:
            rows = self.gather(rows, "the seat group's gather of micro-batch gradients").flatten(0, 1)
        total = rows[0].clone()
        for row in rows[1:]:
            total.add_(row)
        return total
