"""The process-group communicator: N nodes on W <= N ranks of a ``torch.distributed`` group.

Rank r owns the nodes ``blocks(N, W)[r]`` (:mod:`admm_dist.engine.placement`), one when W = N.
As the transport of :mod:`~admm_dist.engine.comm.communicator`: a hop between ranks is an
``isend``/``irecv`` pair, metered as ``consensus`` when posted, with the buffer's exact size; the
sum over ranks is one ``all_reduce`` (metered by the ring convention). A payload above
:attr:`~ProcessGroupCommunicator.segment_bytes` whose receiver works piece by piece travels in
pieces, each used as it lands (the ring's additions overlap the transfer: docs/benchmarks.md).
Every wait is bounded: a dead or diverged peer raises a CommError naming the step. Both sides
post receives, then sends, by (src, dst), tagged by the pair of nodes.
"""
from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from admm_dist.engine.comm.communicator import Arrived, CommError, Communicator, Hop, first_line, wait_all
from admm_dist.engine.comm.meter import CONSENSUS
from admm_dist.engine.placement import blocks, owners


def _pieces(numel: int, itemsize: int, limit: int) -> List[Tuple[int, int]]:
    """[(a, b)]: ``numel`` items cut into near-equal pieces of at most ``limit`` bytes (0: whole)."""
    most = max(1, limit // itemsize)
    if limit <= 0 or numel <= most:
        return [(0, numel)]
    k = -(-numel // most)
    step = -(-numel // k)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def gather_blocks(rows: torch.Tensor, blocks: Sequence[range], group, timeout, what: str) -> torch.Tensor:
    """This rank's rows (one per node of its block) -> every node's, in node order, on every rank."""
    padded = rows.new_zeros(max(len(b) for b in blocks), rows.shape[1])
    padded[:rows.shape[0]] = rows
    out = [torch.empty_like(padded) for _ in blocks]
    wait_all([dist.all_gather(out, padded, group=group, async_op=True)], timeout, what, dist.get_rank(group))
    return torch.cat([out[r][:len(b)] for r, b in enumerate(blocks)], 0)


class ProcessGroupCommunicator(Communicator):
    """Nodes ``blocks(N, W)[rank]`` of this rank, exchanged with the other ranks' blocks."""

    segment_bytes = 4 << 20   # the largest piece of a payload on the wire

    def __init__(self, *, mode: str, n_nodes: int, timeout: datetime.timedelta,
                 group: Optional[dist.ProcessGroup] = None, topology: str = "ring",
                 gossip_steps: int = 1, meter=None, compress: str = "none") -> None:
        if not dist.is_initialized():
            raise CommError("no process group: create one with admm_dist.engine.dist.distributed() first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.blocks = blocks(n_nodes, self.world)   # W > N is refused, naming the fix
        self.owner = owners(n_nodes, self.world)
        super().__init__(mode=mode, n_nodes=n_nodes, nodes=self.blocks[self.rank], topology=topology,
                         gossip_steps=gossip_steps, meter=meter, compress=compress)
        self.timeout = timeout
        self.nccl = dist.get_backend(group) == "nccl"

    def rank_blocks(self) -> List[range]:
        return list(self.blocks)

    def mine(self, node: int) -> bool:
        return self.owner[node] == self.rank

    def _peer(self, node: int) -> int:
        """The global rank that holds ``node``."""
        rank = self.owner[node]
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _wait(self, works: Sequence, what: str) -> None:
        wait_all(works, self.timeout, what, self.rank)

    def _send_recv(self, hops: Sequence[Hop], what: str, got: Dict[Tuple[int, int], torch.Tensor],
                   arrived: Optional[Arrived]) -> None:
        ops, landed = [], []
        limit = self.segment_bytes if arrived is not None else 0   # pieces only for a receiver that uses them
        for hop in hops:   # receives first, so every landing buffer is posted before data flows
            if self.mine(hop.dst):
                got[(hop.src, hop.dst)] = hop.into
                self.meter.add(hop.dst, "irecv", recv=hop.into.nbytes, phase=CONSENSUS)
                for a, b in _pieces(hop.into.numel(), hop.into.element_size(), limit):
                    ops.append((dist.irecv, hop.into[a:b], self._peer(hop.src), hop.src * self.n_nodes + hop.dst))
                    landed.append((hop, a, b))
        for hop in hops:
            if self.mine(hop.src):
                self.meter.add(hop.src, "isend", sent=hop.data.nbytes, phase=CONSENSUS)
                for a, b in _pieces(hop.data.numel(), hop.data.element_size(), limit):
                    ops.append((dist.isend, hop.data[a:b], self._peer(hop.dst), hop.src * self.n_nodes + hop.dst))
        try:   # NCCL needs the batch (one group call); gloo posts each op itself, ~75 us sooner per batch
            works = (dist.batch_isend_irecv([dist.P2POp(*op[:3], self.group, op[3]) for op in ops]) if self.nccl
                     else [fn(t, peer, self.group, tag) for fn, t, peer, tag in ops])
        except Exception as e:  # a peer that died is reported when the next message is posted
            raise CommError(f"rank {self.rank}: posting the messages of {what} failed ({first_line(e)})") from e
        if len(works) != len(ops):   # coalesced (NCCL): one handle for the whole batch
            self._wait(works, what)
            works = [None] * len(ops)
        for (hop, a, b), work in zip(landed, works):
            if work is not None:
                self._wait([work], what)
            if arrived is not None:
                arrived(hop, a, b, hop.into[a:b])
        self._wait([w for w in works[len(landed):] if w is not None], what)

    def _sum_ranks(self, total: torch.Tensor) -> None:
        self._wait([dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group, async_op=True)], "all_reduce")

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dim() != 2 or rows.shape[0] != len(self.nodes):
            raise ValueError(f"gather_rows expects [{len(self.nodes)}, k] rows on rank {self.rank}, "
                             f"got {tuple(rows.shape)}")
        moved = rows.cuda() if rows.device.type == "cpu" and self.nccl else rows   # NCCL moves GPU tensors only
        self._meter_gather(rows.shape[1] * rows.element_size())
        return gather_blocks(moved, self.blocks, self.group, self.timeout, "all_gather of telemetry").to(rows.device)

    def barrier(self) -> None:
        self._wait([dist.barrier(group=self.group, async_op=True)], "barrier")
