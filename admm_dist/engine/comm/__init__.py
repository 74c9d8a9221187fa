"""Communication layer: one interface, a process-group and a single-process implementation.

Use :func:`make_communicator` to get the right one for a run: under torchrun
(a live process group) each rank owns one node, or a contiguous block of nodes when there are
fewer ranks than nodes (:mod:`~admm_dist.engine.comm.blocks`); otherwise all ``n_nodes`` are
simulated in this process.
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch.distributed as dist

from admm_dist.core.constants import DEFAULT_TIMEOUT_S
from admm_dist.core.errors import UserError
from admm_dist.engine.comm.base import CommError, Communicator
from admm_dist.engine.comm.blocks import IN_PROCESS, BlockCommunicator
from admm_dist.engine.comm.compress import COMPRESSIONS
from admm_dist.engine.comm.local import LocalCommunicator
from admm_dist.engine.comm.meter import CONSENSUS, TELEMETRY, ByteMeter, chunk_bounds, chunk_sizes, ring_bytes_per_rank
from admm_dist.engine.comm.modes import DECENTRALIZED, MIXING, MODES, check_mode
from admm_dist.engine.comm.process_group import (
    CoordinatorCommunicator,
    GossipCommunicator,
    ProcessGroupCommunicator,
    RingCommunicator,
)
from admm_dist.engine.comm.placement import blocks
from admm_dist.engine.comm.topology import TOPOLOGIES, half_mean_weights, metropolis_weights, mixing_matrix, neighbours

COMM_BACKENDS = ("auto", "process_group", "local")   # one process per node, all in one, or by the group
_EXACT_PG = {"coordinator": CoordinatorCommunicator, "ring": RingCommunicator}   # MIXING modes: GossipCommunicator


def make_communicator(mode: str, *, n_nodes: int, topology: str = "ring", gossip_steps: int = 1,
                      timeout: Optional[datetime.timedelta] = None,
                      backend: str = "auto", meter: Optional[ByteMeter] = None,
                      compress: str = "none") -> Communicator:
    """Pick the implementation: ``process_group`` (one node per rank, or a block of nodes per
    rank when the world is smaller than ``n_nodes``) or ``local``.

    ``backend="auto"`` uses the process group when one is initialised and
    simulates every node in this process otherwise.
    """
    check_mode(mode, topology, gossip_steps)
    if backend not in COMM_BACKENDS:
        raise UserError(f"backend={backend!r}: choose auto, process_group or local")
    use_pg = backend == "process_group" or (backend == "auto" and dist.is_initialized())
    if not use_pg:
        return LocalCommunicator(mode=mode, n_nodes=n_nodes, topology=topology,
                                 gossip_steps=gossip_steps, meter=meter, compress=compress)
    world = dist.get_world_size() if dist.is_initialized() else 1
    blocks(n_nodes, world)   # W > N is refused, naming the fix
    timeout = timeout or datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    if world < n_nodes or compress != "none":   # several nodes per rank, or node-to-node messages
        return BlockCommunicator(mode=mode, n_nodes=n_nodes, timeout=timeout, topology=topology,
                                 gossip_steps=gossip_steps, meter=meter, compress=compress)
    if mode in MIXING:
        return GossipCommunicator(mode=mode, timeout=timeout, topology=topology, gossip_steps=gossip_steps,
                                  meter=meter)
    return _EXACT_PG[mode](timeout=timeout, topology=topology, gossip_steps=gossip_steps, meter=meter)


__all__ = [
    "MODES", "MIXING", "COMPRESSIONS", "check_mode", "DECENTRALIZED", "TOPOLOGIES", "CONSENSUS", "TELEMETRY", "IN_PROCESS", "ByteMeter", "CommError", "Communicator",
    "BlockCommunicator",
    "LocalCommunicator", "ProcessGroupCommunicator", "CoordinatorCommunicator",
    "RingCommunicator", "GossipCommunicator", "make_communicator", "chunk_bounds",
    "chunk_sizes", "ring_bytes_per_rank", "neighbours", "metropolis_weights", "half_mean_weights", "mixing_matrix",
]
