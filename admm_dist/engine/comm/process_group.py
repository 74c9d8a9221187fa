"""Communicators over a real ``torch.distributed`` process group, one node per rank.

- :class:`CoordinatorCommunicator`: one ``all_reduce`` (sum), then divide by N.
- :class:`RingCommunicator`: a hand-written bandwidth-optimal ring all-reduce on
  ``isend``/``irecv`` only: reduce-scatter then all-gather, N-1 steps each, in
  chunks of about P/N (P need not divide by N). Rank r ends the reduce-scatter
  owning chunk (r+1) mod N.
- :class:`GossipCommunicator`: ``tau`` steps; in each, every rank posts an
  ``irecv`` from and an ``isend`` to each graph neighbour, then mixes with its
  Metropolis-Hastings row.

Every wait is bounded by the communicator's timeout; a peer that died or
diverged raises :class:`CommError` instead of hanging.
"""
from __future__ import annotations

import datetime
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from admm_dist.engine.comm.base import CommError, Communicator, first_line, gossip_combine, ring_accumulate, wait_all
from admm_dist.engine.comm.meter import CONSENSUS, chunk_bounds


class ProcessGroupCommunicator(Communicator):
    """Shared plumbing: metered point-to-point messages and bounded waits."""

    def __init__(self, *, mode: str, timeout: datetime.timedelta,
                 group: Optional[dist.ProcessGroup] = None, topology: str = "ring",
                 gossip_steps: int = 1, meter=None) -> None:
        if not dist.is_initialized():
            raise CommError("no process group: create one with admm_dist.engine.dist.distributed() first")
        self.group = group
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        super().__init__(mode=mode, n_nodes=world, nodes=(self.rank,), topology=topology,
                         gossip_steps=gossip_steps, meter=meter)
        self.timeout = timeout
        self._scratch: Optional[torch.Tensor] = None

    # -- metered primitives --------------------------------------------------
    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _isend(self, t: torch.Tensor, to: int, phase: str = CONSENSUS):
        self.meter.add(self.rank, "isend", sent=t.numel() * t.element_size(), phase=phase)
        return self._post(dist.isend, t, dst=self._peer(to))

    def _irecv(self, t: torch.Tensor, frm: int, phase: str = CONSENSUS):
        self.meter.add(self.rank, "irecv", recv=t.numel() * t.element_size(), phase=phase)
        return self._post(dist.irecv, t, src=self._peer(frm))

    def _post(self, fn, t, **peer):
        try:
            return fn(t, group=self.group, **peer)
        except Exception as e:  # a peer that died is reported when the next message is posted
            raise CommError(f"rank {self.rank}: posting {fn.__name__} to/from {peer} failed "
                            f"({first_line(e)})") from e

    def _wait(self, works: Sequence, what: str) -> None:
        wait_all(works, self.timeout, what, self.rank)

    def _buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        s = self._scratch
        if s is None or s.numel() < numel or s.dtype != like.dtype or s.device != like.device:
            s = self._scratch = torch.empty(numel, dtype=like.dtype, device=like.device)
        return s[:numel]

    # -- shared operations ----------------------------------------------------
    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dim() != 2 or rows.shape[0] != 1:
            raise ValueError(f"gather_rows expects [1, k] rows on a rank, got {tuple(rows.shape)}")
        home = rows.device
        if home.type == "cpu" and dist.get_backend(self.group) == "nccl":
            # NCCL moves only GPU tensors: small rows take a round trip through the device
            rows = rows.to(torch.device("cuda", torch.cuda.current_device()))
        rows = rows.contiguous()
        out: List[torch.Tensor] = [torch.empty_like(rows) for _ in range(self.n_nodes)]
        self._meter_gather(rows.shape[1] * rows.element_size())
        work = dist.all_gather(out, rows, group=self.group, async_op=True)
        self._wait([work], "all_gather of telemetry")
        return torch.cat(out, 0).to(home)

    def barrier(self) -> None:
        self._wait([dist.barrier(group=self.group, async_op=True)], "barrier")

    def close(self) -> None:
        self._scratch = None


class CoordinatorCommunicator(ProcessGroupCommunicator):
    def __init__(self, **kw) -> None:
        super().__init__(mode="coordinator", **kw)

    def consensus_(self, vectors: Sequence[torch.Tensor]) -> None:
        self._check_vectors(vectors)
        (v,) = vectors
        if self.n_nodes == 1:
            return
        self.meter.add(self.rank, "all_reduce", **self.ring_convention(v.numel(), self.rank, v.element_size()))
        work = dist.all_reduce(v, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._wait([work], "all_reduce")
        v.div_(self.n_nodes)


def _segments(numel: int, seg: int):
    """[(start, end)] pieces of at most ``seg`` items (one piece when seg <= 0)."""
    if seg <= 0 or numel <= seg:
        return [(0, numel)]
    k = -(-numel // seg)
    step = -(-numel // k)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


class RingCommunicator(ProcessGroupCommunicator):
    # Chunks longer than ``segment_above`` floats travel in segments of at most
    # ``segment_numel`` (4 MiB); measured on 2 cores: 1.11x -> 1.05-1.08x of gloo's
    # all_reduce at N = 4, 90 MiB (docs/benchmarks.md).
    segment_above = 1 << 20
    segment_numel = 1 << 20

    def __init__(self, **kw) -> None:
        super().__init__(mode="ring", **kw)

    def _pieces(self, numel: int):
        return _segments(numel, self.segment_numel if numel > self.segment_above else 0)

    def consensus_(self, vectors: Sequence[torch.Tensor]) -> None:
        self._check_vectors(vectors)
        (v,) = vectors
        n, r = self.n_nodes, self.rank
        if n == 1:
            return
        bounds = chunk_bounds(v.numel(), n)
        right, left = (r + 1) % n, (r - 1) % n
        buf = self._buffer(max(hi - lo for lo, hi in bounds), v)
        # Reduce-scatter: at step s send chunk r-s, receive chunk r-s-1 and add it in.
        # A large chunk arrives in a few segments, each added as soon as it lands, so the
        # addition overlaps the rest of the transfer; additions are elementwise, so the
        # result is the same bits.
        for s in range(n - 1):
            slo, shi = bounds[(r - s) % n]
            rlo, rhi = bounds[(r - s - 1) % n]
            # sender and receiver split a chunk by its own length: the same pieces
            segs = self._pieces(rhi - rlo)
            works = [self._irecv(buf[a:b], left) for a, b in segs]
            sends = [self._isend(v[slo + a:slo + b], right) for a, b in self._pieces(shi - slo)]
            for (a, b), work in zip(segs, works):
                self._wait([work], f"ring reduce-scatter step {s}")
                ring_accumulate(v[rlo + a:rlo + b], buf[a:b])
            self._wait(sends, f"ring reduce-scatter step {s}")
        lo, hi = bounds[(r + 1) % n]
        v[lo:hi].div_(n)
        # All-gather: at step s send chunk r+1-s, receive chunk r-s in place.
        for s in range(n - 1):
            slo, shi = bounds[(r + 1 - s) % n]
            rlo, rhi = bounds[(r - s) % n]
            works = [self._irecv(v[rlo:rhi], left), self._isend(v[slo:shi], right)]
            self._wait(works, f"ring all-gather step {s}")


class GossipCommunicator(ProcessGroupCommunicator):
    """Neighbour mixing: ``gossip`` (tau Metropolis steps) or ``decentralized`` (one step)."""

    def __init__(self, *, mode: str = "gossip", **kw) -> None:
        super().__init__(mode=mode, **kw)
        self._inbox: Optional[torch.Tensor] = None

    def consensus_(self, vectors: Sequence[torch.Tensor]) -> None:
        self._check_vectors(vectors)
        (v,) = vectors
        if self.n_nodes == 1:
            return
        nbrs = self.neighbours[self.rank]
        row = self.weights[self.rank]
        p = v.numel()
        inbox = self._inbox
        if inbox is None or inbox.shape != (len(nbrs), p) or inbox.dtype != v.dtype or inbox.device != v.device:
            inbox = self._inbox = torch.empty(len(nbrs), p, dtype=v.dtype, device=v.device)
        mixed = self._buffer(p, v)
        for step in range(self.gossip_steps):
            works = [self._irecv(inbox[k], j) for k, j in enumerate(nbrs)]
            works += [self._isend(v, j) for j in nbrs]
            self._wait(works, f"gossip step {step}")
            gossip_combine(mixed, v, row[self.rank], [(row[j], inbox[k]) for k, j in enumerate(nbrs)])
            v.copy_(mixed)

    def close(self) -> None:
        super().close()
        self._inbox = None
