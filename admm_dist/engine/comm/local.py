"""Single-process communicator: all N nodes simulated in one process.

It computes what the distributed implementations compute, with the same
arithmetic in the same order for ``ring`` and ``gossip`` (bit for bit), and
the exact mean for ``coordinator``. It is the test oracle of the distributed
run and the mode for one-GPU users. Its meter counts, per simulated node, the
bytes that node would have sent and received.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from admm_dist.engine.comm.base import Message, NodeLoopCommunicator, gossip_combine, ring_accumulate
from admm_dist.engine.comm.meter import CONSENSUS, chunk_bounds


class LocalCommunicator(NodeLoopCommunicator):
    def __init__(self, *, mode: str, n_nodes: int, topology: str = "ring",
                 gossip_steps: int = 1, meter=None, compress: str = "none") -> None:
        super().__init__(mode=mode, n_nodes=n_nodes, nodes=range(n_nodes),
                         topology=topology, gossip_steps=gossip_steps, meter=meter, compress=compress)

    def rank_blocks(self) -> List[range]:
        return [range(self.n_nodes)]

    def mine(self, node: int) -> bool:
        return True

    def deliver(self, messages: Sequence[Message], what: str,
                device: torch.device) -> Dict[Tuple[int, int], torch.Tensor]:
        got = {}
        for src, dst, payload, nbytes in messages:   # metered as the distributed run sends them
            self.meter.add(src, "isend", sent=nbytes, phase=CONSENSUS)
            self.meter.add(dst, "irecv", recv=nbytes, phase=CONSENSUS)
            got[(src, dst)] = payload
        return got

    def _coordinator(self, vs: Sequence[torch.Tensor]) -> None:
        n = self.n_nodes
        total = vs[0].clone()
        for v in vs[1:]:
            total.add_(v)
        total.div_(n)
        for node, v in enumerate(vs):
            v.copy_(total)
            self.meter.add(node, "all_reduce", **self.ring_convention(v.numel(), node, v.element_size()))

    def _ring(self, vs: Sequence[torch.Tensor]) -> None:
        n = self.n_nodes
        item = vs[0].element_size()
        for c, (lo, hi) in enumerate(chunk_bounds(vs[0].numel(), n)):
            # Chunk c starts at node c and travels right; node c+j adds its own chunk.
            acc = vs[c][lo:hi].clone()
            for j in range(1, n):
                acc = ring_accumulate(vs[(c + j) % n][lo:hi].clone(), acc)
            acc.div_(n)
            for v in vs:
                v[lo:hi].copy_(acc)
            # Reduce-scatter: every node but c-1 forwards chunk c once; all-gather: every node but c-2.
            nbytes = (hi - lo) * item
            for node in range(n):
                if node != (c - 1) % n:
                    self.meter.add(node, "isend", sent=nbytes)
                    self.meter.add((node + 1) % n, "irecv", recv=nbytes)
                if node != (c - 2) % n:
                    self.meter.add(node, "isend", sent=nbytes)
                    self.meter.add((node + 1) % n, "irecv", recv=nbytes)

    def _gossip(self, vs: Sequence[torch.Tensor]) -> None:
        nbytes = vs[0].numel() * vs[0].element_size()
        cur = [v.clone() for v in vs]
        for _ in range(self.gossip_steps):
            nxt = []
            for i, v in enumerate(cur):
                row = self.weights[i]
                out = torch.empty_like(v)
                gossip_combine(out, v, row[i], [(row[j], cur[j]) for j in self.neighbours[i]])
                nxt.append(out)
                for _j in self.neighbours[i]:
                    self.meter.add(i, "isend", sent=nbytes)
                    self.meter.add(i, "irecv", recv=nbytes)
            cur = nxt
        for v, c in zip(vs, cur):
            v.copy_(c)

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dim() != 2 or rows.shape[0] != self.n_nodes:
            raise ValueError(f"gather_rows expects [{self.n_nodes}, k] rows, got {tuple(rows.shape)}")
        self._meter_gather(rows.shape[1] * rows.element_size())
        return rows.clone()
