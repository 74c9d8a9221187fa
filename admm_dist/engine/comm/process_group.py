"""The process-group communicator: N nodes on W <= N ranks of a ``torch.distributed`` group.

Rank r owns the nodes ``blocks(N, W)[r]`` (:mod:`admm_dist.engine.placement`), one when W = N.
A hop between ranks is an ``isend``/``irecv`` pair tagged by (step, src, dst, piece), metered as
``consensus`` when posted; the sum over ranks is one ``all_reduce`` (metered by the ring
convention). Every wait is bounded: a dead or diverged peer raises a CommError naming the step.

Two ways to post a step's messages. *Per message* (gloo's default): each piece is posted the
moment it is ready and matched by its tag. *Grouped* (NCCL's, which needs it, and available on
gloo with ``grouped=True``): a step's messages are held and posted as one
``batch_isend_irecv``, sorted by their tag on every rank, because NCCL ignores tags and matches
the messages between two ranks by their order; on gloo the grouped path posts them all with tag
0, so that a run on gloo depends on that order exactly as a run under NCCL does.
"""
from __future__ import annotations

import datetime
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from admm_dist.core.errors import UserError
from admm_dist.engine.comm.communicator import CommError, Communicator, first_line, wait_all
from admm_dist.engine.placement import blocks


def gather_blocks(rows: torch.Tensor, blocks: Sequence[range], group, timeout, what: str) -> torch.Tensor:
    """This rank's rows (one per node of its block) -> every node's, in node order, on every rank."""
    padded = rows.new_zeros(max(len(b) for b in blocks), rows.shape[1])
    padded[:rows.shape[0]] = rows
    out = [torch.empty_like(padded) for _ in blocks]
    wait_all([dist.all_gather(out, padded, group=group, async_op=True)], timeout, what, dist.get_rank())
    return torch.cat([out[r][:len(b)] for r, b in enumerate(blocks)], 0)


class ProcessGroupCommunicator(Communicator):
    """Nodes ``blocks(N, W)[rank]`` of this rank, exchanged with the other ranks' blocks."""

    segment_bytes = 16 << 20   # the largest piece of an fp32 payload on the wire (docs/benchmarks.md)

    def __init__(self, *, mode: str, n_nodes: int, timeout: datetime.timedelta,
                 group: Optional[dist.ProcessGroup] = None, topology: str = "ring",
                 gossip_steps: int = 1, meter=None, compress: str = "none",
                 grouped: Optional[bool] = None) -> None:
        if not dist.is_initialized():   # ``group``: this rank's column across seats (engine/dist.py)
            raise CommError("no process group: create one with admm_dist.engine.dist.distributed() first")
        self.group, self.world = group, dist.get_world_size(group)
        rank = dist.get_rank(group)
        super().__init__(mode=mode, n_nodes=n_nodes, blocks=blocks(n_nodes, self.world), rank=rank,
                         topology=topology, gossip_steps=gossip_steps, meter=meter, compress=compress)
        self.timeout = timeout
        self.nccl = dist.get_backend(group) == "nccl"
        if grouped is False and self.nccl:
            raise UserError("grouped=False: NCCL posts a step's messages as one group call; "
                            "leave grouped unset (None) or True")
        self.grouped = self.nccl if grouped is None else bool(grouped)
        self._held: List[Tuple[int, dist.P2POp]] = []   # grouped: a step's messages and their tags

    def _peer(self, node: int) -> int:
        """The global rank that holds ``node`` (also in messages)."""
        rank = self.owner[node]
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _p2p(self, what: str, send: bool, tensor: torch.Tensor, node: int, tag: int):
        fn, peer = dist.isend if send else dist.irecv, self._peer(node)
        if self.grouped:   # held back: a step's messages go as one group call (_wait), matched by order
            return self._held.append((tag, dist.P2POp(fn, tensor, peer, self.group, 0)))
        where = f"{what} {'to' if send else 'from'} rank {peer}"
        return self._posting(where, lambda: fn(tensor, peer, self.group, tag))

    def _wait(self, works: Sequence, what: str) -> None:
        if self._held:   # in tag order on every rank: the i-th message from A to B meets B's i-th from A
            held, self._held = [op for _, op in sorted(self._held, key=lambda t: t[0])], []
            works = [*self._posting(what, lambda: dist.batch_isend_irecv(held)), *works]
        wait_all([w for w in works if w is not None], self.timeout, what, dist.get_rank())   # the global rank

    def _posting(self, what: str, post):
        try:
            return post()
        except Exception as e:  # a peer that died is reported when the next message is posted
            raise CommError(f"rank {dist.get_rank()}: posting the messages of {what} failed "
                            f"({first_line(e)})") from e

    def relay(self, steps, what: str, size: int) -> None:
        """Per message, each message is posted itself (a batch costs ~75 us more on gloo) and each
        piece made and forwarded when ready (:meth:`Communicator.relay`). NCCL queues the
        messages to one peer on one stream, where a receive posted ahead of a send would block
        it: grouped, each step is one group call (``batch_isend_irecv``) of its messages."""
        if not self.grouped:
            return super().relay(steps, what, size)
        for s, step in enumerate(steps):
            super().relay([step], f"{what} step {s}" if len(steps) > 1 else what, size)

    def _pieces(self, size: int, n_steps: int, unit: int) -> int:
        """Pieces per hop: 2 of fp32 (one is added while the other is on the wire; more cost more
        per message than they overlap, on 2 cores: docs/benchmarks.md), more where a piece would
        exceed :attr:`segment_bytes`, one below 256 KiB; coded payloads (``unit`` > 1) in pieces
        of at most :attr:`coded_bytes`, so the codec's work on one overlaps the wire's on the
        others (and its scratch holds one piece); fewer if the tags (step, src, dst, piece)
        would not fit. Grouped: fp32 hops whole (one group call a step), coded ones in the same
        pieces as per message."""
        if size == 0:
            return 1
        if self.grouped:
            pieces = super()._pieces(size, n_steps, unit)
        else:
            biggest = self.segment_bytes if unit == 1 else self.coded_bytes
            pieces = max(2 if size >= 512 << 10 else 1, -(-size // biggest))
        return max(1, min(pieces, (2 ** 31 - 1) // (n_steps * self.n_nodes ** 2)))

    def _sum_ranks(self, total: torch.Tensor) -> None:
        self._wait([dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group, async_op=True)],
                   "all_reduce")

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        moved = rows.cuda() if rows.device.type == "cpu" and self.nccl else rows   # NCCL: GPU tensors only
        every = gather_blocks(moved, self.blocks, self.group, self.timeout, "all_gather of telemetry")
        return every.to(rows.device)

    def barrier(self) -> None:
        self._wait([dist.barrier(group=self.group, async_op=True)], "barrier")
