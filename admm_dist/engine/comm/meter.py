"""Byte meter: every byte each node sends and receives through the communicator.

Counts are kept per round, node, phase (``consensus``: the z-step payload on the wire;
``in_process``: hops between two nodes of one rank, copied in memory; ``telemetry``: rows
gathered for every rank) and primitive (``isend``, ``irecv``, ``copy``, ``all_reduce``,
``all_gather``). A point-to-point message is recorded when it is posted, with the buffer's exact
size; a collective whose wire pattern is the backend's, by the ring convention
(:func:`ring_bytes_per_rank`), which the benchmark checks against the loopback interface.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from admm_dist.engine.placement import even_split

CONSENSUS = "consensus"       # the z-step's payload on the wire
TELEMETRY = "telemetry"       # rows every rank needs (the rounds' figures, the collections' records)
IN_PROCESS = "in_process"     # the bytes a hop between two nodes of one rank copies in memory


@dataclasses.dataclass
class Count:
    sent: int = 0
    recv: int = 0
    calls: int = 0

    def __iadd__(self, other: "Count") -> "Count":
        self.sent += other.sent
        self.recv += other.recv
        self.calls += other.calls
        return self


Key = Tuple[int, str, str]  # (node, phase, primitive), within one round


class ByteMeter:
    """Accumulates byte counts; cheap enough to sit on every message."""

    def __init__(self) -> None:
        self.round = 0
        self._rounds: Dict[int, Dict[Key, Count]] = defaultdict(lambda: defaultdict(Count))

    def start_round(self, k: int) -> None:
        self.round = int(k)

    def add(self, node: int, primitive: str, *, sent: int = 0, recv: int = 0,
            phase: str = CONSENSUS) -> None:
        c = self._rounds[self.round][(node, phase, primitive)]
        c.sent += int(sent)
        c.recv += int(recv)
        c.calls += 1

    def total(self, *, node: Optional[int] = None, round: Optional[int] = None,
              phase: Optional[str] = None, primitive: Optional[str] = None) -> Count:
        """Sum of the counts that match every given field."""
        out = Count()
        rounds = self._rounds.items() if round is None else [(round, self._rounds.get(round, {}))]
        for _, counts in rounds:
            for (n, ph, prim), c in counts.items():
                if ((node is None or n == node) and (phase is None or ph == phase)
                        and (primitive is None or prim == primitive)):
                    out += c
        return out

    def reset(self) -> None:
        self._rounds.clear()


def chunk_sizes(numel: int, n: int) -> List[int]:
    """Split ``numel`` elements into ``n`` near-equal chunks
    (:func:`~admm_dist.engine.placement.even_split`)."""
    return [len(r) for r in even_split(numel, n)]


def chunk_bounds(numel: int, n: int) -> List[Tuple[int, int]]:
    return [(r.start, r.stop) for r in even_split(numel, n)]


def ring_bytes_per_rank(numel: int, n: int, rank: int, itemsize: int = 4) -> int:
    """Bytes rank ``rank`` sends (and receives) in a ring all-reduce of ``numel`` items.

    Reduce-scatter sends every chunk but ``(rank+1) % n``; all-gather every
    chunk but ``(rank+2) % n``: ``2(n-1)/n * numel`` items up to chunk rounding.
    """
    if n <= 1:
        return 0
    sizes = chunk_sizes(numel, n)
    return itemsize * (2 * numel - sizes[(rank + 1) % n] - sizes[(rank + 2) % n])
