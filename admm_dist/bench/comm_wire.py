"""The wire side of the communication benchmark (``python -m admm_dist.bench.comm``).

It owns how bytes on the wire are counted: :func:`interface_tx_bytes` (an interface's
transmitted-bytes counter from the kernel: on one host the ranks talk over loopback, and
``/proc/net/dev`` counts every byte sent on ``lo`` once in ``tx``; the counter is machine-wide,
so callers bracket the operation with barriers and read it on one rank),
:func:`tcp_socket_bytes` (what this process's own TCP sockets sent and retransmitted, from
``getsockopt(TCP_INFO)``), :func:`wire_bracket` (the
machine's loopback counter and those socket counters read around one operation, between
barriers) and :func:`wire_fields` (the kept bracket of a (method, size) and the per-rank
figures made from it: ``wire_bytes_per_rank``, ``tcp_retrans_bytes_per_rank``,
``wire_net_bytes_per_rank``, ``tcp_payload_bytes_per_rank`` and the raw trials). What those
figures mean is in :mod:`admm_dist.bench.comm`'s docstring.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from typing import Dict, Optional, Sequence, Tuple

READ_SETTLE_S = 0.02
IFACE = "lo"

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
            # rx: bytes packets errs drop fifo frame compressed multicast; tx: bytes ...
            return int(fields[8])
    return None


_TCP_INFO_BYTES_SENT = 200  # struct tcp_info: __u64 tcpi_bytes_sent, then __u64 tcpi_bytes_retrans


def tcp_socket_bytes() -> Optional[Tuple[int, int]]:
    """(bytes sent, bytes retransmitted) summed over this process's TCP sockets, or None.

    Read with ``getsockopt(TCP_INFO)`` on a duplicate of every socket descriptor
    in ``/proc/self/fd`` (Linux 4.19+). ``bytes sent`` counts TCP payload, gloo's
    message headers included and retransmissions included; no IP/TCP headers.
    """
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    sent = retrans = 0
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            if len(info) < _TCP_INFO_BYTES_SENT + 16:
                return None  # kernel too old to report bytes_sent / bytes_retrans
            a, b = struct.unpack_from("QQ", info, _TCP_INFO_BYTES_SENT)
            sent, retrans = sent + a, retrans + b
        except OSError:
            continue
        finally:
            s.close()  # closes the duplicate only
    return sent, retrans


def wire_bracket(comm, rank: int, op) -> Tuple[Optional[int], Optional[Tuple[int, int]]]:
    """Counters across barrier | barrier op barrier.

    Returns (loopback tx bytes of the machine, read on rank 0; None elsewhere,
    (bytes sent, bytes retransmitted) by this rank's TCP sockets). Every rank
    waits READ_SETTLE_S before each read so that trailing messages (barrier
    replies, late retransmissions) have landed.
    """

    comm.barrier()
    time.sleep(READ_SETTLE_S)
    lo0 = interface_tx_bytes(IFACE) if rank == 0 else None
    sock0 = tcp_socket_bytes()
    comm.barrier()
    if op is not None:
        op()
    comm.barrier()
    time.sleep(READ_SETTLE_S)
    lo1 = interface_tx_bytes(IFACE) if rank == 0 else None
    sock1 = tcp_socket_bytes()
    lo = None if lo0 is None or lo1 is None else lo1 - lo0
    sock = None if sock0 is None or sock1 is None else (sock1[0] - sock0[0], sock1[1] - sock0[1])
    return lo, sock


def wire_fields(per_rank: Sequence[Dict[str, object]], n: int, analytic: float) -> Dict[str, object]:
    """Pick the kept wire bracket and turn the raw counters into per-rank figures."""
    trials = len(per_rank[0]["wire_op"])
    lo_op = [per_rank[0]["wire_op"][i][0] for i in range(trials)]
    lo_base = [per_rank[0]["wire_base"][i][0] for i in range(trials)]
    sock_op = [[pr["wire_op"][i][1] for pr in per_rank] for i in range(trials)]
    sock_base = [[pr["wire_base"][i][1] for pr in per_rank] for i in range(trials)]
    have_sock = all(x is not None for t in sock_op + sock_base for x in t)
    # bytes sent and retransmitted by all ranks' sockets, per trial
    sent = [sum(x[0] for x in t) for t in sock_op] if have_sock else None
    rtx = [sum(x[1] for x in t) for t in sock_op] if have_sock else None
    out: Dict[str, object] = {"wire_bytes_per_rank": None, "wire_over_analytic": None,
                              "tcp_retrans_bytes_per_rank": None, "wire_net_bytes_per_rank": None,
                              "tcp_payload_bytes_per_rank": None, "wire_trials": trials}
    idx = list(range(trials))
    if have_sock:
        idx = [i for i in idx if rtx[i] == 0] or idx  # brackets without retransmissions, if any
    if all(x is not None for x in lo_op + lo_base):
        best = min(idx, key=lambda i: lo_op[i])
        wire = (lo_op[best] - min(lo_base)) / n
        out.update(wire_bytes_per_rank=wire, wire_over_analytic=wire / analytic if analytic else None,
                   wire_trials_op_bytes=lo_op, wire_trials_baseline_bytes=lo_base)
    else:
        best = min(idx, key=lambda i: sent[i]) if have_sock else None
    if have_sock and best is not None:
        base_sent = min(sum(x[0] for x in t) for t in sock_base)
        out.update(tcp_retrans_bytes_per_rank=rtx[best] / n,
                   tcp_payload_bytes_per_rank=(sent[best] - rtx[best] - base_sent) / n,
                   tcp_trials_retrans_bytes=rtx)
        if out["wire_bytes_per_rank"] is not None:
            out["wire_net_bytes_per_rank"] = out["wire_bytes_per_rank"] - rtx[best] / n
    return out
