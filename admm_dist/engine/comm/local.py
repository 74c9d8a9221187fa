"""The single-process communicator: all N nodes in one process.

Every hop of an algorithm is a hop between two nodes of this process, so the algorithms of
:mod:`~admm_dist.engine.comm.communicator` run with no rank involved, and the sum over ranks is
nothing. It is the test oracle of every distributed placement (the same code with every node in
one block) and the mode for one-GPU users. Its meter counts, per node, the bytes that node would
send and receive as one rank of an N-rank run (phase ``consensus``), not the copies it makes.
"""
from __future__ import annotations

import torch

from admm_dist.engine.comm.communicator import Communicator
from admm_dist.engine.comm.meter import CONSENSUS


class LocalCommunicator(Communicator):
    def __init__(self, *, mode: str, n_nodes: int, topology: str = "ring",
                 gossip_steps: int = 1, meter=None, compress: str = "none") -> None:
        super().__init__(mode=mode, n_nodes=n_nodes, blocks=[range(n_nodes)], rank=0,
                         topology=topology, gossip_steps=gossip_steps, meter=meter, compress=compress)

    def _meter_copy(self, src: int, dst: int, size: int) -> None:   # as an N-rank run sends it
        self.meter.add(src, "isend", sent=size, phase=CONSENSUS)
        self.meter.add(dst, "irecv", recv=size, phase=CONSENSUS)

    def _p2p(self, what: str, send: bool, tensor: torch.Tensor, node: int, tag: int):
        raise AssertionError(f"{what}: every node lives in this process")

    def _wait(self, works, what: str) -> None:
        """Nothing is ever posted."""

    def _sum_ranks(self, total: torch.Tensor) -> None:
        """One process: the sum is its own."""

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.clone()
