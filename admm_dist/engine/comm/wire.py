"""Bytes that actually crossed a network interface, from the kernel's counters.

On one host the ranks talk over loopback; ``/proc/net/dev`` counts every byte
sent on ``lo`` once in ``tx`` (and again in ``rx``: count one of them). The
counter is machine-wide, so callers bracket the operation with barriers and
read it on one rank; the difference divided by the number of ranks is the
mean bytes per rank on the wire, TCP/IP headers included.
"""
from __future__ import annotations

from typing import Optional

PROC_NET_DEV = "/proc/net/dev"


def interface_tx_bytes(iface: str = "lo", path: str = PROC_NET_DEV) -> Optional[int]:
    """Transmitted-bytes counter of ``iface``, or None where the kernel does not expose it."""
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()[2:]
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name.strip() == iface:
            fields = rest.split()
            return int(fields[8])  # rx: bytes packets errs drop fifo frame compressed multicast; tx: bytes ...
    return None
