"""What a consensus algorithm is: an object that owns what it keeps from round to round.

An :class:`Algorithm` replaces each node's vector in place (``consensus_``) as a schedule of
node-to-node messages that it hands the transport it is given for the call (a
:class:`~.schedule.Transport`: the communicator, which keeps no algorithm's data). It owns its
per-node state (the public copies of compressed consensus, checkpointed with the node:
:meth:`Algorithm.state`), its scratch buffers and, when it compresses, its codec. The
communicator picks one at construction (:data:`~.communicator.ALGORITHMS`); the families:
:mod:`~.exact` (the exact mean in fp32), :mod:`~.mixing` (neighbour mixing in fp32),
:mod:`~.compressed` (both, on compressed payloads).
"""
from __future__ import annotations

import abc
from typing import Dict, Sequence

import torch

from admm_dist.engine.comm.schedule import Transport
from admm_dist.engine.comm.topology import Graph


class Algorithm(abc.ABC):
    """One consensus algorithm on the N nodes of ``graph`` (``compress``: its payload format)."""

    def __init__(self, graph: Graph, compress: str = "none") -> None:
        self.graph = graph
        self.n_nodes = len(graph.neighbours)
        self._state: Dict[int, Dict[str, torch.Tensor]] = {}   # per node: what it keeps between calls
        self._scratch: Dict[object, torch.Tensor] = {}

    @abc.abstractmethod
    def consensus_(self, transport: Transport, vectors: Sequence[torch.Tensor]) -> None:
        """Replace the vectors of ``transport``'s nodes (in its node order) in place; N > 1."""

    @abc.abstractmethod
    def bytes_sent(self, numel: int, node: int, itemsize: int = 4) -> int:
        """Bytes ``node`` sends in one consensus_ of ``numel`` items of ``itemsize`` bytes; N > 1."""

    # -- per-node state (checkpointed with the node) -----------------------------------------
    def state(self, node: int) -> Dict[str, torch.Tensor]:
        return dict(self._state.get(node, {}))

    def load_state(self, node: int, tensors: Dict[str, torch.Tensor]) -> None:
        self._state[node] = {k: t.detach().clone() for k, t in tensors.items()}

    def slot(self, node: int, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """State ``name`` of ``node``: ``numel`` fp32 values on ``like``'s device, zero at first."""
        state = self._state.setdefault(node, {})
        t = state.get(name)
        if t is None:
            t = state[name] = torch.zeros(numel, dtype=torch.float32, device=like.device)
        return t

    # -- scratch ------------------------------------------------------------------------------
    def buffer(self, key: object, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A scratch tensor kept between calls (``numel`` items like ``like``)."""
        s = self._scratch.get(key)
        if s is None or s.numel() < numel or s.dtype != like.dtype or s.device != like.device:
            s = self._scratch[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return s[:numel]

    def close(self) -> None:
        """Release the scratch buffers (the state stays)."""
        self._scratch.clear()
