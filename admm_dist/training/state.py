"""Typed per-run state the trainer keeps between rounds: each node's optimiser and shard, and
the best round seen on the held-out set."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, Optional

import torch

if TYPE_CHECKING:
    from admm_dist.data.sampler import RoleBalancedSampler


@dataclasses.dataclass
class NodeState:
    """One node of this rank: its encoded shard, its minibatch sampler, its Adam state."""
    node: int
    encoded: list
    sampler: Optional["RoleBalancedSampler"]   # None: no examples (f_i = 0)
    optimizer: torch.optim.Optimizer


@dataclasses.dataclass
class BestRound:
    """The round whose consensus z had the lowest held-out NLL (written as ``<out>-best``)."""
    dev_nll: float
    round: int
    z: torch.Tensor

    def meta(self) -> List[float]:
        """What a checkpoint stores besides the tensor: ``[dev_nll, round]``."""
        return [self.dev_nll, self.round]
