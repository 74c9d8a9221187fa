"""A communicator for several nodes per rank: N nodes on W <= N ranks of a process group.

Rank r owns a contiguous block of nodes (:mod:`~admm_dist.engine.comm.placement`). Every mode
runs the single-process oracle's algorithm over the N nodes; a hop between two nodes of one
rank happens in memory (metered under :data:`IN_PROCESS`, apart from the wire bytes of
:data:`~admm_dist.engine.comm.meter.CONSENSUS`), a hop between ranks is an ``isend``/``irecv``.

- ``ring``: the oracle's ring over nodes 0..N-1 (reduce-scatter then all-gather, chunk c
  starting at node c), each partial sum formed as ``own + incoming`` in the oracle's order:
  every node's z is bit for bit the oracle's, whatever W.
- ``gossip``: each step, every node mixes its Metropolis row over its neighbours in ascending
  order (:func:`~admm_dist.engine.comm.base.gossip_combine`): bit for bit the oracle's.
- ``coordinator``: the rank sums its block in node order, one ``all_reduce`` sums the ranks,
  then divides by N: the exact mean up to float round-off (the summation order is the backend's).

Messages between the same two ranks are posted in one order on both sides (sender node, then
receiver node) and tagged with the pair, so several per step never cross. Every wait is bounded
by the communicator's timeout.
"""
from __future__ import annotations

import datetime
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from admm_dist.engine.comm.base import (
    CommError,
    NodeLoopCommunicator,
    Message,
    first_line,
    gossip_combine,
    ring_accumulate,
    wait_all,
)
from admm_dist.engine.comm.meter import CONSENSUS, chunk_bounds
from admm_dist.engine.comm.placement import blocks, owners

IN_PROCESS = "in_process"   # the bytes a hop between two nodes of one rank copies in memory


class BlockCommunicator(NodeLoopCommunicator):
    """Nodes ``blocks(N, W)[rank]`` of this rank, exchanged with the other ranks' blocks."""

    def __init__(self, *, mode: str, n_nodes: int, timeout: datetime.timedelta,
                 group: Optional[dist.ProcessGroup] = None, topology: str = "ring",
                 gossip_steps: int = 1, meter=None, compress: str = "none") -> None:
        if not dist.is_initialized():
            raise CommError("no process group: create one with admm_dist.engine.dist.distributed() first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.blocks = blocks(n_nodes, self.world)
        self.owner = owners(n_nodes, self.world)
        super().__init__(mode=mode, n_nodes=n_nodes, nodes=self.blocks[self.rank], topology=topology,
                         gossip_steps=gossip_steps, meter=meter, compress=compress)
        self.timeout = timeout
        self.index: Dict[int, int] = {node: j for j, node in enumerate(self.nodes)}

    # -- placement --------------------------------------------------------------
    def rank_blocks(self) -> List[range]:
        return list(self.blocks)

    def mine(self, node: int) -> bool:
        return self.owner[node] == self.rank

    def _tag(self, src: int, dst: int) -> int:
        return src * self.n_nodes + dst

    # -- metered primitives ----------------------------------------------------
    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _op(self, send: bool, t: torch.Tensor, src: int, dst: int) -> dist.P2POp:
        nbytes = t.numel() * t.element_size()
        if send:
            self.meter.add(src, "isend", sent=nbytes, phase=CONSENSUS)
            return dist.P2POp(dist.isend, t, self._peer(self.owner[dst]), self.group, self._tag(src, dst))
        self.meter.add(dst, "irecv", recv=nbytes, phase=CONSENSUS)
        return dist.P2POp(dist.irecv, t, self._peer(self.owner[src]), self.group, self._tag(src, dst))

    def _copied(self, t: torch.Tensor, src: int, dst: int) -> None:
        nbytes = t.numel() * t.element_size()
        self.meter.add(src, "copy", sent=nbytes, phase=IN_PROCESS)
        self.meter.add(dst, "copy", recv=nbytes, phase=IN_PROCESS)

    def _wait(self, works: Sequence, what: str) -> None:
        wait_all(works, self.timeout, what, self.rank)

    def _exchange(self, hops: List[Tuple[int, int, Optional[torch.Tensor], Optional[torch.Tensor]]],
                  what: str) -> None:
        """Each hop (src, dst, payload at src, landing buffer at dst) whose ends are on two
        ranks: this rank's sends and receives, posted as one batch in (src, dst) order."""
        ops = []
        for src, dst, payload, landing in sorted(hops, key=lambda h: (h[0], h[1])):
            if self.mine(src) and not self.mine(dst):
                ops.append(self._op(True, payload, src, dst))
            elif self.mine(dst) and not self.mine(src):
                ops.append(self._op(False, landing, src, dst))
        if not ops:
            return
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:  # a peer that died is reported when the next message is posted
            raise CommError(f"rank {self.rank}: posting the messages of {what} failed ({first_line(e)})") from e
        self._wait(works, what)

    def deliver(self, messages: Sequence[Message], what: str,
                device: torch.device) -> Dict[Tuple[int, int], torch.Tensor]:
        got: Dict[Tuple[int, int], torch.Tensor] = {}
        hops = []
        for src, dst, payload, nbytes in messages:
            if self.mine(src) and self.mine(dst):
                self._copied(payload, src, dst)
                got[(src, dst)] = payload
            elif self.mine(dst):
                got[(src, dst)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
                hops.append((src, dst, None, got[(src, dst)]))
            elif self.mine(src):
                hops.append((src, dst, payload, None))
        self._exchange(hops, what)
        return got

    # -- consensus ---------------------------------------------------------------
    def _coordinator(self, vs: Sequence[torch.Tensor]) -> None:
        total = vs[0].clone()
        for v in vs[1:]:
            total.add_(v)
        for node, v in zip(self.nodes, vs):
            self.meter.add(node, "all_reduce", **self.ring_convention(v.numel(), node, v.element_size()))
        work = dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._wait([work], "all_reduce")
        total.div_(self.n_nodes)
        for v in vs:
            v.copy_(total)

    def _ring(self, vs: Sequence[torch.Tensor]) -> None:
        n = self.n_nodes
        bounds = chunk_bounds(vs[0].numel(), n)
        here = {node: vs[j] for j, node in enumerate(self.nodes)}
        biggest = max(hi - lo for lo, hi in bounds)
        inbox = {node: torch.empty(biggest, dtype=vs[0].dtype, device=vs[0].device)
                 for node in self.nodes if not self.mine((node - 1) % n)}
        # Reduce-scatter, step s: node i hands chunk i-s to node i+1, which adds it to its own.
        for s in range(n - 1):
            hops = self._ring_hops(here, bounds, lambda i: i - s,
                                   lambda dst, lo, hi: inbox[dst][:hi - lo] if dst in inbox else None)
            self._exchange(hops, f"ring reduce-scatter step {s}")
            for i, dst, payload, landing in hops:
                if not self.mine(dst):
                    continue
                lo, hi = bounds[(i - s) % n]
                if self.mine(i):
                    self._copied(payload, i, dst)
                    ring_accumulate(here[dst][lo:hi], payload)
                else:
                    ring_accumulate(here[dst][lo:hi], landing)
        for node in self.nodes:   # node i now holds chunk i+1 summed over every node
            lo, hi = bounds[(node + 1) % n]
            here[node][lo:hi].div_(n)
        # All-gather, step s: node i hands chunk i+1-s to node i+1, which takes it as is.
        for s in range(n - 1):
            hops = self._ring_hops(here, bounds, lambda i: i + 1 - s, lambda dst, lo, hi: here[dst][lo:hi])
            self._exchange(hops, f"ring all-gather step {s}")
            for i, dst, payload, landing in hops:
                if self.mine(i) and self.mine(dst):
                    self._copied(payload, i, dst)
                    landing.copy_(payload)

    def _ring_hops(self, here: Dict[int, torch.Tensor], bounds: List[Tuple[int, int]], chunk: Callable[[int], int],
                   landing: Callable[[int, int, int], Optional[torch.Tensor]]) -> List[tuple]:
        """The hops of one ring step that touch this rank: node i hands chunk ``chunk(i)`` (mod N)
        to node i+1; ``landing(dst, lo, hi)`` is where that chunk lands at a node of this rank."""
        n = self.n_nodes
        hops = []
        for i in range(n):
            dst = (i + 1) % n
            if self.mine(i) or self.mine(dst):
                lo, hi = bounds[chunk(i) % n]
                hops.append((i, dst, here[i][lo:hi] if self.mine(i) else None,
                             landing(dst, lo, hi) if self.mine(dst) else None))
        return hops

    def _gossip(self, vs: Sequence[torch.Tensor]) -> None:
        here = {node: vs[j] for j, node in enumerate(self.nodes)}
        p = vs[0].numel()
        for step in range(self.gossip_steps):
            inbox: Dict[Tuple[int, int], torch.Tensor] = {}
            hops = []
            for i in self.nodes:
                for j in self.neighbours[i]:
                    if self.mine(j):
                        continue
                    inbox[(j, i)] = torch.empty(p, dtype=vs[0].dtype, device=vs[0].device)
                    hops.append((j, i, None, inbox[(j, i)]))   # j's vector lands at i
                    hops.append((i, j, here[i], None))         # i's vector goes to j
            self._exchange(hops, f"gossip step {step}")
            mixed = {}
            for i in self.nodes:
                row = self.weights[i]
                incoming = []
                for j in self.neighbours[i]:
                    if self.mine(j):
                        self._copied(here[j], j, i)
                        incoming.append((row[j], here[j]))
                    else:
                        incoming.append((row[j], inbox[(j, i)]))
                mixed[i] = gossip_combine(torch.empty_like(here[i]), here[i], row[i], incoming)
            for i in self.nodes:
                here[i].copy_(mixed[i])

    # -- telemetry ---------------------------------------------------------------
    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dim() != 2 or rows.shape[0] != len(self.nodes):
            raise ValueError(f"gather_rows expects [{len(self.nodes)}, k] rows on rank {self.rank}, "
                             f"got {tuple(rows.shape)}")
        home = rows.device
        if home.type == "cpu" and dist.get_backend(self.group) == "nccl":
            rows = rows.to(torch.device("cuda", torch.cuda.current_device()))
        widest = max(len(b) for b in self.blocks)
        padded = torch.zeros(widest, rows.shape[1], dtype=rows.dtype, device=rows.device)
        padded[:rows.shape[0]] = rows
        out: List[torch.Tensor] = [torch.empty_like(padded) for _ in range(self.world)]
        self._meter_gather(rows.shape[1] * rows.element_size())
        work = dist.all_gather(out, padded, group=self.group, async_op=True)
        self._wait([work], "all_gather of telemetry")
        return torch.cat([out[r][:len(b)] for r, b in enumerate(self.blocks)], 0).to(home)

    def barrier(self) -> None:
        self._wait([dist.barrier(group=self.group, async_op=True)], "barrier")
