"""Control agreement between ranks, apart from the consensus path.

Every rank of a run must take the same decisions: whether to go on after a check ("every rank
says yes"), whether a peer failed while writing ("any rank says so"), which checkpoint round
every rank holds ("the newest round all ranks have": a minimum), which nodes lack a file. These
questions are small integers, not vectors: :class:`Control` answers them, and carries the few
per-node figures a report needs from every rank (:meth:`Control.table`).

It runs on its own gloo group (:attr:`admm_dist.engine.dist.DistContext.control`): on CPU even when
the consensus group is NCCL, with every wait bounded by the run's timeout, and never through the
communicator, so none of it enters the consensus byte meter. :class:`Control` itself is the
single-process implementation (a world of one answers every question itself);
:class:`GroupControl` asks every rank.
"""
from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, List, Mapping, Sequence

import torch
import torch.distributed as dist

from admm_dist.engine.comm.communicator import wait_all
from admm_dist.engine.comm.process_group import gather_blocks

if TYPE_CHECKING:
    from admm_dist.engine.dist import DistContext

MAX_TABLE_COLUMNS = 16   # a control table carries a few figures per node, not data


class Control:
    """Agreement among the ranks holding the node blocks ``blocks`` (one process: one block; a
    seat group's ranks all hold its node)."""

    def __init__(self, blocks: Sequence[range]) -> None:
        self.blocks = [range(b.start, b.stop) for b in blocks]
        order = [node for b in self.blocks for node in b]   # the gathered rows' nodes, in rank order
        self.n_nodes = len(set(order))
        # a node held by a seat group's k ranks (W = k x N): its first rank's row stands for it
        first = {}
        for row, node in enumerate(order):
            first.setdefault(node, row)
        self._first = [first[node] for node in range(self.n_nodes)]

    # -- the questions ------------------------------------------------------------------------
    def all(self, yes: bool) -> bool:
        """True on every rank when every rank says yes."""
        return bool(self._reduce([int(bool(yes))], dist.ReduceOp.MIN)[0])

    def any(self, yes: bool) -> bool:
        """True on every rank when some rank says yes (a peer failed, a signal arrived)."""
        return bool(self._reduce([int(bool(yes))], dist.ReduceOp.MAX)[0])

    def min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the newest round every rank holds)."""
        return self._reduce([int(value)], dist.ReduceOp.MIN)[0]

    def max(self, value: int) -> int:
        return self._reduce([int(value)], dist.ReduceOp.MAX)[0]

    def nodes_where(self, flags: Mapping[int, bool]) -> List[int]:
        """Every node some rank flagged (each rank flags its own nodes), in node order."""
        marks = [0] * self.n_nodes
        for node, flag in flags.items():
            marks[node] = int(bool(flag))
        return [node for node, m in enumerate(self._reduce(marks, dist.ReduceOp.MAX)) if m]

    def table(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(own block), k] rows of this rank's nodes -> [n_nodes, k] on every rank, node order."""
        own = self.blocks[self.rank]
        if rows.dim() != 2 or rows.shape[0] != len(own) or rows.shape[1] > MAX_TABLE_COLUMNS:
            raise ValueError(f"a control table takes [{len(own)}, k <= {MAX_TABLE_COLUMNS}] rows on rank "
                             f"{self.rank}, got {tuple(rows.shape)}")
        return self._table(rows.detach().cpu())

    def per_rank(self, row: Sequence[float]) -> List[List[float]]:
        """A few figures of this rank (at most 16) -> every rank's, in rank order."""
        if len(row) > MAX_TABLE_COLUMNS:
            raise ValueError(f"per_rank takes at most {MAX_TABLE_COLUMNS} figures, got {len(row)}")
        return self._rows(torch.tensor([list(row)], dtype=torch.float64)).tolist()

    def barrier(self) -> None:
        """Return once every rank is here."""
        self.all(True)

    # -- the single process -----------------------------------------------------------------
    rank = 0

    def _reduce(self, values: List[int], op) -> List[int]:
        return list(values)

    def _table(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.clone()

    def _rows(self, row: torch.Tensor) -> torch.Tensor:
        return row.clone()


class GroupControl(Control):
    """Agreement over ``group`` (a gloo group), every wait bounded by ``timeout``."""

    def __init__(self, group: dist.ProcessGroup, blocks: Sequence[range],
                 timeout: datetime.timedelta) -> None:
        super().__init__(blocks)
        self.group = group
        self.rank = dist.get_rank(group)
        self.timeout = timeout

    def _reduce(self, values: List[int], op) -> List[int]:
        t = torch.tensor(values, dtype=torch.int64)
        wait_all([dist.all_reduce(t, op=op, group=self.group, async_op=True)], self.timeout,
                 "agreement between ranks", self.rank)
        return [int(v) for v in t.tolist()]

    def _table(self, rows: torch.Tensor) -> torch.Tensor:
        return gather_blocks(rows, self.blocks, self.group, self.timeout,
                             "gathering a control table")[self._first]

    def _rows(self, row: torch.Tensor) -> torch.Tensor:
        every = [torch.empty_like(row) for _ in self.blocks]
        wait_all([dist.all_gather(every, row, group=self.group, async_op=True)], self.timeout,
                 "gathering figures of every rank", self.rank)
        return torch.cat(every, 0)


def control_for(ctx: "DistContext", blocks: Sequence[range]) -> Control:
    """The agreement of this launch: over its control group, or this process alone."""
    if ctx.control is None:
        return Control(blocks)
    return GroupControl(ctx.control, blocks, ctx.timeout)
