"""What each seat deploys in the middle of a run: the state a re-collection rolls each seat out
under (``recollect_every``), and under ``kl_ref collect`` the KL reference each node then trains
against. At the end of a run the same choice is written to files by
:mod:`admm_dist.training.outputs`.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

from admm_dist.training.config import TrainConfig


def deployed_states(cfg: TrainConfig, engine, comm, n_local: int) -> Dict[int, torch.Tensor]:
    """{seat: the vector that seat deploys now}, the same on every rank: the one consensus z
    where consensus is exact, else its own node's z_i (x_i under local_only), all-gathered."""
    seats = cfg.adapted_seats()
    if comm.exact and not cfg.local_only:
        z = engine.z[0].detach().clone()
        return {s: z for s in seats}
    mine = [engine.x[j] if cfg.local_only else engine.z[j] for j in range(n_local)]
    every = comm.gather_rows(torch.stack([v.detach().float().reshape(-1) for v in mine]))
    return {s: every[0 if cfg.pooled else i].clone() for i, s in enumerate(seats)}


def kl_references(cfg: TrainConfig, states: Dict[int, torch.Tensor], nodes: Sequence[int]) -> Dict[int, torch.Tensor]:
    """``kl_ref collect`` after a re-collection: {node: the state its seat collected with}."""
    seats = cfg.adapted_seats()
    return {node: states[seats[0] if cfg.pooled else seats[node]] for node in nodes}
