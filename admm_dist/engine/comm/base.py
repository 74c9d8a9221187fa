"""The communicator interface the ADMM engine talks to.

A communicator owns a fixed set of *nodes* (training seats): one per process
under torchrun, all of them in the single-process simulation. The engine hands
it one flat vector per node it owns and never sees ranks or process groups.

``consensus_`` replaces each v_i in place:

- ``coordinator`` and ``ring``: by the exact mean (1/N) sum_j v_j;
- ``gossip``: by ``tau`` steps of neighbour mixing v_i <- sum_j W_ij v_j (Metropolis W);
- ``decentralized``: by one step of v_i <- (v_i + mean_{j in N_i} v_j) / 2, the neighbour
  exchange of node-based decentralized ADMM (the engine feeds it x, not x + u; see
  :mod:`admm_dist.engine.admm`).

The arithmetic of a ring chunk and of a gossip step is defined once here
(:func:`ring_accumulate`, :func:`gossip_combine`) and used by both the
process-group and the single-process implementations, so that the two agree
bit for bit where the summation order is ours (ring, gossip).
"""
from __future__ import annotations

import abc
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from admm_dist.core.errors import RunError, UserError
from admm_dist.engine.comm import compressed
from admm_dist.engine.comm.compress import check_compress
from admm_dist.engine.comm.meter import TELEMETRY, ByteMeter, ring_bytes_per_rank
from admm_dist.engine.comm.modes import DECENTRALIZED, MIXING, check_mode
from admm_dist.engine.comm.topology import half_mean_weights, metropolis_weights, neighbours

class CommError(RunError):
    """A communication step failed (a peer died, timed out, or disagreed)."""


def first_line(e: BaseException) -> str:
    """A backend's error as one short line (gloo and NCCL raise long multi-line texts)."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def wait_all(works: Sequence, timeout, what: str, rank: int) -> None:
    """Wait for every pending operation, each bounded by ``timeout``; a failure or a timeout is
    a :class:`CommError` naming the rank and the step."""
    start = time.monotonic()
    try:
        for w in works:
            w.wait(timeout)
    except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with long texts
        raise CommError(f"rank {rank}: {what} {_how_long(time.monotonic() - start, timeout.total_seconds())} "
                        f"({first_line(e)})") from e


def _how_long(elapsed: float, bound: float) -> str:
    """A failed wait's phrase: it timed out (it took about the bound), or it failed at once."""
    if elapsed >= 0.9 * bound:
        return f"timed out after {bound:.0f}s"
    return f"failed after {elapsed:.1f}s (a peer closed the connection or stopped, not a timeout)"


# A message between two nodes: (source node, destination node, payload (at the source's rank;
# None elsewhere), its size in bytes)
Message = Tuple[int, int, Optional[torch.Tensor], int]


def ring_accumulate(own: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
    """One reduce-scatter step: the receiving node adds the incoming partial sum to its own chunk."""
    return own.add_(incoming)


def gossip_combine(out: torch.Tensor, own: torch.Tensor, w_own: float,
                   incoming: Sequence[Tuple[float, torch.Tensor]]) -> torch.Tensor:
    """out = W_ii v_i + sum_j W_ij v_j, neighbours taken in ascending order."""
    torch.mul(own, w_own, out=out)
    for w, t in incoming:
        out.add_(t, alpha=w)
    return out


class Communicator(abc.ABC):
    """Exchanges flat vectors between the N nodes of one ADMM problem."""

    def __init__(self, *, mode: str, n_nodes: int, nodes: Sequence[int],
                 topology: str = "ring", gossip_steps: int = 1,
                 meter: Optional[ByteMeter] = None, compress: str = "none") -> None:
        check_mode(mode, topology, gossip_steps)
        self.compress = check_compress(compress)
        # per node: the public copies of compressed consensus (admm_dist.engine.comm.compressed)
        self.compress_state: Dict[int, Dict[str, torch.Tensor]] = {}
        if n_nodes < 1:
            raise UserError(f"n_nodes={n_nodes}: a consensus problem needs at least one node")
        self.mode = mode
        self.n_nodes = int(n_nodes)
        self.nodes: Tuple[int, ...] = tuple(nodes)
        self.topology = topology
        self.gossip_steps = int(gossip_steps)
        self.meter = meter if meter is not None else ByteMeter()
        self.neighbours: List[List[int]] = neighbours(topology, self.n_nodes)
        self.weights = (half_mean_weights(self.neighbours) if mode == DECENTRALIZED
                        else metropolis_weights(self.neighbours))

    @property
    def exact(self) -> bool:
        """True when consensus_ returns the exact mean (every z_i is one point z)."""
        return self.mode not in MIXING or self.n_nodes == 1

    def penalty_scale(self, node: int) -> float:
        """rho_i / rho for ``node``'s x-step: 1, but d_i / mean degree under ``decentralized``.

        Node-based decentralized ADMM (Shi et al. 2014) has one constant c and gives node i the
        proximal weight 2 c d_i; c = rho / (2 * mean degree) makes the mean weight rho, so a
        setting of rho couples as strongly as in the other modes (exactly rho on every node of
        a regular graph: ring, complete, expander for a power of two)."""
        if self.mode != DECENTRALIZED or self.n_nodes == 1:
            return 1.0
        mean_degree = sum(len(n) for n in self.neighbours) / self.n_nodes
        return self.degree(node) / mean_degree

    def rank_blocks(self) -> List[range]:
        """The nodes of each rank, in rank order (one rank per node unless overridden)."""
        return [range(i, i + 1) for i in range(self.n_nodes)]

    def mine(self, node: int) -> bool:
        """Whether ``node`` lives in this process."""
        return node in self.nodes

    def deliver(self, messages: Sequence[Message], what: str,
                device: torch.device) -> Dict[Tuple[int, int], torch.Tensor]:
        """Send each message whose source is here, receive each whose destination is here (uint8
        payloads); returns what arrived at this process's nodes, keyed (source, destination).
        The compressed modes exchange through this alone."""
        raise NotImplementedError(f"{type(self).__name__} does not deliver node-to-node messages")

    # -- per-node state of compressed consensus (checkpointed with the node) -----------------
    def node_state(self, node: int) -> Dict[str, torch.Tensor]:
        return dict(self.compress_state.get(node, {}))

    def load_node_state(self, node: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.compress_state[node] = {k: t.detach().clone() for k, t in tensors.items()}

    def degree(self, node: int) -> int:
        return len(self.neighbours[node])

    def analytic_bytes(self, numel: int, node: int, itemsize: int = 4) -> int:
        """Bytes ``node`` sends in one consensus_ of ``numel`` items (ring convention for all_reduce)."""
        if self.n_nodes == 1:
            return 0
        if self.compress != "none":
            return compressed.bytes_sent(self, numel, node)
        if self.mode in MIXING:
            return self.gossip_steps * self.degree(node) * numel * itemsize
        return ring_bytes_per_rank(numel, self.n_nodes, node, itemsize)

    def ring_convention(self, numel: int, node: int, itemsize: int = 4) -> dict:
        """What a ring all-reduce would send from ``node`` and deliver to it (from its left)."""
        n = self.n_nodes
        return {"sent": ring_bytes_per_rank(numel, n, node, itemsize),
                "recv": ring_bytes_per_rank(numel, n, (node - 1) % n, itemsize)}

    def _check_vectors(self, vectors: Sequence[torch.Tensor]) -> None:
        if len(vectors) != len(self.nodes):
            raise ValueError(f"consensus_ got {len(vectors)} vectors for {len(self.nodes)} local node(s)")
        for v in vectors:
            if v.dim() != 1 or not v.is_contiguous() or not v.is_floating_point():
                raise ValueError("consensus_ works on contiguous 1-D floating-point vectors "
                                 f"(got shape {tuple(v.shape)}, dtype {v.dtype}): flatten it first")
        if len({v.numel() for v in vectors}) > 1:
            raise ValueError("every node's vector must have the same length")

    @abc.abstractmethod
    def consensus_(self, vectors: Sequence[torch.Tensor]) -> None:
        """Replace each local node's vector in place (exact mean, or tau gossip steps)."""

    @abc.abstractmethod
    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[len(nodes), k] local rows -> [n_nodes, k] for every node, in node order.

        For telemetry (losses, residual norms, hashes) and the seats' states before a
        re-collection where consensus is inexact; metered as ``telemetry``.
        """

    def barrier(self) -> None:
        """Wait for every node (a no-op in one process)."""

    def close(self) -> None:
        """Release buffers; the process group itself belongs to :mod:`admm_dist.engine.dist`."""

    def _meter_gather(self, row_bytes: int) -> None:
        n = self.n_nodes
        for node in self.nodes:
            self.meter.add(node, "all_gather", sent=row_bytes * (n - 1),
                           recv=row_bytes * (n - 1), phase=TELEMETRY)


class NodeLoopCommunicator(Communicator):
    """A communicator that serves every mode itself, node by node: the single-process one and
    the one that holds several nodes per rank. ``consensus_`` picks the compressed exchange or
    the mode's own method."""

    def consensus_(self, vectors: Sequence[torch.Tensor]) -> None:
        self._check_vectors(vectors)
        if self.n_nodes == 1:
            return
        if self.compress != "none":
            compressed.consensus_(self, vectors)
        elif self.mode in MIXING:
            self._gossip(vectors)
        elif self.mode == "ring":
            self._ring(vectors)
        else:
            self._coordinator(vectors)

    @abc.abstractmethod
    def _coordinator(self, vs: Sequence[torch.Tensor]) -> None:
        """Every vector becomes the exact mean (summed in node order)."""

    @abc.abstractmethod
    def _ring(self, vs: Sequence[torch.Tensor]) -> None:
        """The exact mean by the chunked ring's order of summation."""

    @abc.abstractmethod
    def _gossip(self, vs: Sequence[torch.Tensor]) -> None:
        """``gossip_steps`` neighbour-mixing steps (one, for ``decentralized``)."""
