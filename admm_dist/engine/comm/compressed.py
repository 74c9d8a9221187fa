"""Compressed consensus (``compress int8 | fp8``): every payload is a node's *change* against a
public copy that sender and receivers keep bit-identical, so the error of the compressor
(:mod:`~admm_dist.engine.comm.compress`) vanishes as the iterates settle and ADMM reaches the
optimum itself, not a neighbourhood of it.

Written once as schedules of node-to-node messages over :meth:`Communicator.exchange` (in
memory between nodes of one process, on the wire between ranks), so the single-process oracle
and every placement run the same arithmetic in the same order and agree bit for bit.

- **Mixing modes** (``gossip``, ``decentralized``): CHOCO-Gossip's public copies (Koloskova,
  Stich, Jaggi 2019). Node i keeps its public copy h_i and a copy of each neighbour's h_j.
  Per mixing step it sends q_i = Q(v_i - h_i) to its neighbours; sender and receivers add
  the decoded q_i to their copies of h_i; then v_i <- v_i + sum_j W_ij (h_j - h_i). With
  exact copies that is sum_j W_ij v_j, the uncompressed step. For ``decentralized`` the dual
  then moves by (1/2)(h_i - mean_j h_j): the increments of sum_i alpha_i cancel exactly, as
  node-based decentralized ADMM needs for its fixed point to be the optimum.
- **Exact-mean modes** (``coordinator``, ``ring``): a reduce-scatter to the chunk owners, then
  an all-gather, both compressed. Node i keeps h_i (its public copy) and sends chunk c of
  Q(v_i - h_i) to node c, which sums the decoded chunks in fp32 in node order, keeps the
  exact running mean H_c of the h's, and sends Q(H_c - zhat_c) to every node; every node adds
  it to its copy zhat, and z_i = zhat on every node, bit for bit. A value is quantized once
  on its way in and once on its way out, never per hop; a ring that re-quantizes partial sums
  at every hop piles up N - 1 quantization errors per chunk (docs/benchmarks.md measures both).

State (per node, checkpointed with the node: :meth:`Communicator.node_state`): ``hat.<j>``
for the mixing modes (j = the node and its neighbours), ``h``, ``zhat`` and ``H`` (the node's
own chunk) for the exact-mean modes. It starts at zero.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Sequence

import torch

from admm_dist.engine.comm.compress import decode_, encode, payload_bytes
from admm_dist.engine.comm.meter import chunk_bounds
from admm_dist.engine.comm.topology import MIXING

if TYPE_CHECKING:
    from admm_dist.engine.comm.communicator import Communicator


def _slot(comm: "Communicator", node: int, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    state = comm.compress_state.setdefault(node, {})
    t = state.get(name)
    if t is None:
        t = state[name] = torch.zeros(numel, dtype=torch.float32, device=like.device)
    return t


def _decoded(payload: torch.Tensor, numel: int, compress: str, like: torch.Tensor) -> torch.Tensor:
    return decode_(torch.empty(numel, dtype=torch.float32, device=like.device), payload, compress)


def consensus_(comm: "Communicator", vectors: Sequence[torch.Tensor]) -> None:
    if comm.mode in MIXING:
        _mix(comm, vectors)
    else:
        _owner_mean(comm, vectors)


def bytes_sent(comm: "Communicator", numel: int, node: int) -> int:
    """What ``node`` sends in one compressed consensus_ of ``numel`` values."""
    n, c = comm.n_nodes, comm.compress
    if comm.mode in MIXING:
        return comm.gossip_steps * len(comm.neighbours[node]) * payload_bytes(numel, c)
    sizes = [hi - lo for lo, hi in chunk_bounds(numel, n)]
    return sum(payload_bytes(s, c) for k, s in enumerate(sizes) if k != node) + (n - 1) * payload_bytes(sizes[node], c)


def _mix(comm: "Communicator", vs: Sequence[torch.Tensor]) -> None:
    here = dict(zip(comm.nodes, vs))
    p, c = vs[0].numel(), comm.compress
    size = payload_bytes(p, c)
    for step in range(comm.gossip_steps):
        sent: Dict[int, torch.Tensor] = {}
        for i in comm.nodes:
            own = _slot(comm, i, f"hat.{i}", p, vs[0])
            sent[i] = encode(here[i] - own, c)
            own.add_(_decoded(sent[i], p, c, vs[0]))
        hops = [comm.byte_hop(i, j, sent.get(i), size, vs[0].device) for i in range(comm.n_nodes) for j in comm.neighbours[i]]
        got = comm.exchange(hops, f"compressed mixing step {step}")
        for j in comm.nodes:
            for i in comm.neighbours[j]:
                _slot(comm, j, f"hat.{i}", p, vs[0]).add_(_decoded(got[(i, j)], p, c, vs[0]))
        mixed = {}
        for i in comm.nodes:
            row, own = comm.weights[i], comm.compress_state[i][f"hat.{i}"]
            out = here[i].clone()
            for j in comm.neighbours[i]:
                out.add_(comm.compress_state[i][f"hat.{j}"] - own, alpha=row[j])
            mixed[i] = out
        for i in comm.nodes:
            here[i].copy_(mixed[i])


def _owner_mean(comm: "Communicator", vs: Sequence[torch.Tensor]) -> None:
    n, c = comm.n_nodes, comm.compress
    p = vs[0].numel()
    bounds = chunk_bounds(p, n)
    here = dict(zip(comm.nodes, vs))
    sizes = [payload_bytes(hi - lo, c) for lo, hi in bounds]
    # reduce-scatter: chunk k of node i's change goes to node k
    ins: Dict[int, List[torch.Tensor]] = {}
    for i in comm.nodes:
        h = _slot(comm, i, "h", p, vs[0])
        change = here[i] - h
        ins[i] = []
        for lo, hi in bounds:
            q = encode(change[lo:hi], c)
            h[lo:hi].add_(_decoded(q, hi - lo, c, vs[0]))
            ins[i].append(q)
    hops = [comm.byte_hop(i, k, ins[i][k] if comm.mine(i) else None, sizes[k], vs[0].device)
            for i in range(n) for k in range(n) if k != i]
    got = comm.exchange(hops, "compressed reduce-scatter")
    outs: Dict[int, torch.Tensor] = {}
    for k in comm.nodes:   # node k owns chunk k: the exact mean of the h's, then its change for all
        lo, hi = bounds[k]
        total = torch.zeros(hi - lo, dtype=torch.float32, device=vs[0].device)
        for i in range(n):
            total.add_(_decoded(ins[k][k] if i == k else got[(i, k)], hi - lo, c, vs[0]))
        mean = _slot(comm, k, "H", hi - lo, vs[0])
        mean.add_(total.div_(n))
        zhat = _slot(comm, k, "zhat", p, vs[0])
        outs[k] = encode(mean - zhat[lo:hi], c)
    hops = [comm.byte_hop(k, j, outs.get(k), sizes[k], vs[0].device) for k in range(n) for j in range(n) if j != k]
    got = comm.exchange(hops, "compressed all-gather")
    for j in comm.nodes:
        zhat = _slot(comm, j, "zhat", p, vs[0])
        for k, (lo, hi) in enumerate(bounds):
            zhat[lo:hi].add_(_decoded(outs[k] if k == j else got[(k, j)], hi - lo, c, vs[0]))
        here[j].copy_(zhat)
