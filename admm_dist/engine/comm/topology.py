"""The consensus modes, the gossip graphs and their Metropolis-Hastings mixing weights.

Modes: ``coordinator`` and ``ring`` reach the exact mean; ``gossip`` and ``decentralized`` mix
neighbours (:data:`MIXING`), each node keeping its own z_i.

Every graph is undirected, has no self-loops, and is connected for ``n >= 2``:

- ``ring``: i ~ i +- 1 (mod n).
- ``complete``: every pair.
- ``expander``: the exponential graph, i ~ i +- 2^k (mod n) for
  2^k < n. Its degree is O(log n) and its spectral gap stays bounded away from
  zero as n grows, which is what an expander is used for here.
- ``grid``: a rows x cols 2-D grid without wrap-around, 4-neighbourhood, where
  rows is the largest divisor of n not above sqrt(n). A prime n > 3 has no such grid and is
  refused (2 and 3 nodes are the 1 x n grids, i.e. chains).
- ``chain``: the path i ~ i + 1.

Weights: W_ij = 1 / (1 + max(d_i, d_j)) on edges, W_ii = 1 - sum_j W_ij.
W is symmetric and doubly stochastic, so gossip preserves the mean. Decentralized ADMM mixes
with W_ii = 1/2, W_ij = 1 / (2 d_i) (:func:`half_mean_weights`): row-stochastic only; its
exactness comes from the duals, not from the weights. A :class:`Graph` is what a consensus
algorithm is given of all this (:func:`graph`).
"""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Tuple

from admm_dist.core.errors import UserError

TOPOLOGIES = ("ring", "complete", "expander", "grid", "chain")
MODES = ("coordinator", "ring", "gossip", "decentralized")
MIXING = ("gossip", "decentralized")   # neighbour mixing: each node keeps its own z_i
DECENTRALIZED = "decentralized"


def check_mode(mode: str, topology: str, gossip_steps: int) -> None:
    if mode not in MODES:
        raise UserError(f"consensus={mode!r} is unknown: choose one of {', '.join(MODES)}")
    if topology not in TOPOLOGIES:
        raise UserError(f"topology={topology!r} is unknown: choose one of {', '.join(TOPOLOGIES)}")
    if mode == "gossip" and gossip_steps < 1:
        raise UserError(f"gossip_steps={gossip_steps}: gossip needs at least one mixing step (>= 1)")
    if mode == DECENTRALIZED and gossip_steps != 1:
        raise UserError(f"gossip_steps={gossip_steps}: consensus decentralized exchanges once per round; "
                        "gossip_steps is for consensus gossip (drop it, or set gossip_steps=1)")


def _grid_shape(n: int) -> Tuple[int, int]:
    rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    if rows == 1 and n > 3:
        raise UserError(f"topology grid: {n} nodes form no rows x cols grid with rows, cols >= 2 "
                        f"({n} is prime): use topology ring or chain, or a node count like {n + 1}")
    return rows, n // rows


def neighbours(topology: str, n: int) -> List[List[int]]:
    """Sorted neighbour lists of the graph on nodes 0..n-1."""
    if topology not in TOPOLOGIES:
        raise UserError(f"unknown topology {topology!r}: choose one of {', '.join(TOPOLOGIES)}")
    edges = set()

    def link(i: int, j: int) -> None:
        if i != j:
            edges.add((min(i, j), max(i, j)))

    if topology == "ring":
        for i in range(n):
            link(i, (i + 1) % n)
    elif topology == "complete":
        for i in range(n):
            for j in range(i + 1, n):
                link(i, j)
    elif topology == "expander":
        step = 1
        while step < n:
            for i in range(n):
                link(i, (i + step) % n)
            step *= 2
    elif topology == "grid":
        rows, cols = _grid_shape(n)
        for r in range(rows):
            for c in range(cols):
                i = r * cols + c
                if c + 1 < cols:
                    link(i, i + 1)
                if r + 1 < rows:
                    link(i, i + cols)
    elif topology == "chain":
        for i in range(n - 1):
            link(i, i + 1)
    nbrs: List[List[int]] = [[] for _ in range(n)]
    for i, j in sorted(edges):
        nbrs[i].append(j)
        nbrs[j].append(i)
    return [sorted(x) for x in nbrs]


def metropolis_weights(nbrs: List[List[int]]) -> List[Dict[int, float]]:
    """Row i maps each neighbour j (and i itself) to W_ij."""
    deg = [len(x) for x in nbrs]
    rows = []
    for i, ns in enumerate(nbrs):
        row = {j: 1.0 / (1.0 + max(deg[i], deg[j])) for j in ns}
        row[i] = 1.0 - sum(row.values())
        rows.append(row)
    return rows


def half_mean_weights(nbrs: List[List[int]]) -> List[Dict[int, float]]:
    """Row i: 1/2 for i itself, 1 / (2 d_i) for each neighbour j: z_i = (x_i + mean_j x_j) / 2."""
    rows = []
    for i, ns in enumerate(nbrs):
        row = {j: 0.5 / len(ns) for j in ns}
        row[i] = 0.5 if ns else 1.0
        rows.append(row)
    return rows


class Graph(NamedTuple):
    """Who mixes with whom and how: what a consensus algorithm is given (N = len(neighbours))."""
    neighbours: List[List[int]]      # sorted, per node
    weights: List[Dict[int, float]]  # row i: W_ij for each neighbour j and i itself
    steps: int                       # mixing steps per consensus (gossip_steps)


def graph(mode: str, topology: str, n: int, steps: int = 1) -> Graph:
    """The graph of ``topology`` on ``n`` nodes with the weights ``mode`` mixes by (Metropolis;
    the half mean for ``decentralized``)."""
    nbrs = neighbours(topology, n)
    return Graph(nbrs, (half_mean_weights if mode == DECENTRALIZED else metropolis_weights)(nbrs), int(steps))
