"""Schedules: what a consensus algorithm hands the transport (:meth:`Communicator.relay`).

A :class:`Hop` is one message from node to node, a :class:`Step` the hops that move together
(with the callbacks that make a piece before it goes and see it land), :func:`pieces` how a
message is cut, and :class:`Transport` what an algorithm sees of a communicator: it is handed
one per call and keeps none.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch


def pieces(numel: int, k: int, unit: int = 1) -> List[Tuple[int, int]]:
    """[(a, b)]: ``numel`` items cut into ``k`` near-equal pieces at multiples of ``unit`` (some
    empty when there are fewer units than pieces)."""
    units = -(-numel // unit)
    return [(min(p * units // k * unit, numel), min((p + 1) * units // k * unit, numel)) for p in range(k)]


class Hop(NamedTuple):
    """One message of a schedule: node ``src`` hands ``data`` to node ``dst``."""
    src: int
    dst: int
    data: Optional[torch.Tensor]   # the payload, where ``src`` lives (None elsewhere)
    into: Optional[torch.Tensor]   # where it lands, where ``dst`` lives and ``src`` does not


Arrived = Callable[[Hop, int, int, torch.Tensor], None]   # (hop, a, b, piece): items [a, b) landed
Make = Callable[[int, int, int], None]                     # (node, p, k): fill piece p of k it sends


class Step(NamedTuple):
    """One step of a relay. ``make(node, p, k)`` fills piece p (of k) of what ``node`` sends in this
    step just before it goes (a codec encodes it there); ``arrived(hop, a, b, piece)`` sees items
    [a, b) of a hop land (and decodes them); pieces are cut at multiples of ``unit`` items."""
    hops: Sequence[Hop]
    arrived: Optional[Arrived] = None
    make: Optional[Make] = None
    unit: int = 1


class Transport(Protocol):
    """The communicator as an algorithm uses it (:class:`~.communicator.Communicator`): where the
    nodes live, and the moves of messages between them, metered where they touch this process."""
    n_nodes: int
    nodes: Tuple[int, ...]   # the nodes of this process

    def mine(self, node: int) -> bool:
        """Whether ``node`` lives in this process."""

    def relay(self, steps: Sequence[Step], what: str, size: int) -> None:
        """Run steps of hops, each piece made and seen as it goes (``size``: the largest hop's bytes)."""

    def exchange(self, hops: Sequence[Hop], what: str) -> Dict[Tuple[int, int], torch.Tensor]:
        """Move one step of hops; per hop into a node here, keyed (src, dst), what it delivered."""

    def byte_hop(self, src: int, dst: int, payload: Optional[torch.Tensor], size: int, like: torch.Tensor,
                 step: int = 0) -> Hop:
        """A hop of ``size`` bytes, with a landing buffer where it comes from another process."""

    def landing(self, key: object, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer (kept between calls) where a hop from another process lands."""

    def all_reduce_(self, total: torch.Tensor) -> None:
        """``total`` := its sum over every process (one sum, the backend's order)."""
