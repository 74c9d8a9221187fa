"""Communication layer: every consensus algorithm written once, over two transports.

:mod:`~.communicator` is the interface the engine talks to and the transport (moves and meters
node-to-node messages; picks the algorithm); the algorithms are objects that own their state,
scratch and codec (:mod:`~.algorithm`: the base; :mod:`~.exact`, :mod:`~.mixing`,
:mod:`~.compressed`: the families), handed the transport per call as schedules of messages
(:mod:`~.schedule`). :class:`LocalCommunicator` runs every node in one process (the oracle),
:class:`ProcessGroupCommunicator` a contiguous block of nodes per rank of a live process group
(one node per rank when W = N). :func:`make_communicator` picks one for a run.
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch.distributed as dist

from admm_dist.core.constants import DEFAULT_TIMEOUT_S
from admm_dist.core.errors import UserError
from admm_dist.engine.comm.communicator import CommError, Communicator, Hop
from admm_dist.engine.codec import COMPRESSIONS
from admm_dist.engine.comm.local import LocalCommunicator
from admm_dist.engine.comm.meter import (CONSENSUS, IN_PROCESS, TELEMETRY, ByteMeter, chunk_bounds,
                                         chunk_sizes, ring_bytes_per_rank)
from admm_dist.engine.comm.topology import DECENTRALIZED, MIXING, MODES, check_mode
from admm_dist.engine.comm.process_group import ProcessGroupCommunicator
from admm_dist.engine.comm.topology import TOPOLOGIES, half_mean_weights, metropolis_weights, neighbours

COMM_BACKENDS = ("auto", "process_group", "local")   # nodes spread over ranks, or all in one process


def make_communicator(mode: str, *, n_nodes: int, topology: str = "ring", gossip_steps: int = 1,
                      timeout: Optional[datetime.timedelta] = None, backend: str = "auto",
                      meter: Optional[ByteMeter] = None, compress: str = "none",
                      group: Optional[dist.ProcessGroup] = None) -> Communicator:
    """``process_group`` (a block of nodes per rank of ``group``, the default group unless given:
    with k > 1 ranks per seat, this rank's column across seats, :class:`~admm_dist.engine.dist.RankMesh`)
    or ``local``; ``auto`` takes the process group when one is initialised."""
    check_mode(mode, topology, gossip_steps)
    if backend not in COMM_BACKENDS:
        raise UserError(f"backend={backend!r}: choose auto, process_group or local")
    if backend == "local" or (backend == "auto" and not dist.is_initialized()):
        return LocalCommunicator(mode=mode, n_nodes=n_nodes, topology=topology,
                                 gossip_steps=gossip_steps, meter=meter, compress=compress)
    return ProcessGroupCommunicator(mode=mode, n_nodes=n_nodes, group=group, topology=topology,
                                    gossip_steps=gossip_steps, meter=meter, compress=compress,
                                    timeout=timeout or datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))


__all__ = ["MODES", "MIXING", "DECENTRALIZED", "TOPOLOGIES", "COMPRESSIONS", "CONSENSUS", "TELEMETRY",
           "IN_PROCESS", "ByteMeter", "CommError", "Communicator", "Hop", "LocalCommunicator",
           "ProcessGroupCommunicator", "check_mode", "make_communicator", "chunk_bounds", "chunk_sizes",
           "ring_bytes_per_rank", "neighbours", "metropolis_weights", "half_mean_weights"]
