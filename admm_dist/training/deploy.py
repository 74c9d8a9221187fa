"""What each seat deploys in the middle of a run: the state a re-collection rolls each seat out
under (``recollect_every``), and under ``kl_ref collect`` the KL reference each node then trains
against. Each node's part of it is kept in every checkpoint until the next collection, so a run
resumed between two collections makes the last one again under the same states. At the end of
a run the same choice is written to files by :mod:`admm_dist.training.outputs`.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from admm_dist.training.config import TrainConfig


def node_vectors(cfg: TrainConfig, engine, n_local: int) -> List[torch.Tensor]:
    """What each of this rank's nodes deploys now: its z_i (x_i under local_only)."""
    return [(engine.x[j] if cfg.local_only else engine.z[j]).detach().float().reshape(-1).clone()
            for j in range(n_local)]


def seat_states(cfg: TrainConfig, comm, vectors: Sequence[torch.Tensor]) -> Dict[int, torch.Tensor]:
    """{seat: the vector that seat deploys}, the same on every rank, from each local node's
    vector (:func:`node_vectors`, now or as a checkpoint kept it): the one consensus z where
    consensus is exact, else each seat its own node's, all-gathered."""
    seats = cfg.adapted_seats()
    if comm.exact and not cfg.local_only:
        z = vectors[0]
        return {s: z for s in seats}
    every = comm.gather_rows(torch.stack(list(vectors)))
    return {s: every[0 if cfg.pooled else i].clone() for i, s in enumerate(seats)}


def kl_references(cfg: TrainConfig, states: Dict[int, torch.Tensor], nodes: Sequence[int]) -> Dict[int, torch.Tensor]:
    """``kl_ref collect`` after a re-collection: {node: the state its seat collected with}."""
    seats = cfg.adapted_seats()
    return {node: states[seats[0] if cfg.pooled else seats[node]] for node in nodes}
