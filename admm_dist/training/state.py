"""Typed per-run state the trainer keeps between rounds, each piece with ``state_dict()`` and
``load_state_dict()``: a node's optimiser and sampler (:class:`NodeState`), the best round on the
held-out set (:class:`BestRound`) and what the run has recorded (:class:`RunRecord`). A checkpoint
is written from these and the engine's ``state_dict()``, and restored into them
(:mod:`admm_dist.training.resume`); the report only copies them (:meth:`RunRecord.fill`)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

import torch

if TYPE_CHECKING:
    from admm_dist.data.sampler import RoleBalancedSampler
    from admm_dist.training.report import TrainReport


@dataclasses.dataclass
class NodeState:
    """One node of this rank: its encoded shard, its minibatch sampler, its Adam state."""
    node: int
    encoded: list
    sampler: Optional["RoleBalancedSampler"]   # None: no examples (f_i = 0)
    optimizer: torch.optim.Optimizer
    sampling: Optional[str] = None   # grpo: the digest of its examples' sampling log-probs


@dataclasses.dataclass
class BestRound:
    """The round whose consensus z had the lowest held-out NLL (written as ``<out>-best``)."""
    dev_nll: float
    round: int
    z: torch.Tensor

    def state_dict(self) -> Dict[str, Any]:
        return {"dev_nll": self.dev_nll, "round": self.round, "z": self.z}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "BestRound":
        return cls(float(state["dev_nll"]), int(state["round"]), state["z"])


@dataclasses.dataclass
class RunRecord:
    """What the run has recorded as it went, which a resume carries on: each collection's figures,
    every query key the run trained on (evaluation must avoid them all), the held-out curve."""
    collections: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    anchor_keys_all: List[str] = dataclasses.field(default_factory=list)
    dev_curve: List[Dict[str, float]] = dataclasses.field(default_factory=list)

    def add_collection(self, stats: Mapping[str, Any], anchor_keys: List[str]) -> None:
        """One collection's stats, and its query keys added to ``anchor_keys_all`` (in order)."""
        self.collections.append({k: v for k, v in stats.items() if k != "per_group_outcomes"})
        self.add_anchor_keys(anchor_keys)

    def add_anchor_keys(self, anchor_keys: List[str]) -> None:
        """Query keys the run trained on (a collection's, or a fit-set file's), added in order."""
        seen = set(self.anchor_keys_all)
        self.anchor_keys_all += [k for k in anchor_keys if k not in seen]

    def add_dev_point(self, round_: int, dev_nll: float) -> None:
        self.dev_curve.append({"round": round_, "dev_nll": dev_nll})

    def state_dict(self) -> Dict[str, Any]:
        return {"collections": [dict(c) for c in self.collections],
                "anchor_keys_all": list(self.anchor_keys_all),
                "dev_curve": [dict(p) for p in self.dev_curve]}

    def load_state_dict(self, state: Mapping[str, Any], *, before_collection: Optional[int] = None) -> None:
        """Restore a checkpoint's record; the collections from ``before_collection`` on are left
        out (the resume makes that one again). A checkpoint written before the run collected
        keeps what this attempt has recorded so far."""
        if state["collections"]:
            self.collections = [dict(c) for c in state["collections"]
                                if before_collection is None or c.get("collection", 0) < before_collection]
        if state["anchor_keys_all"]:
            self.anchor_keys_all = []
            self.add_anchor_keys(list(state["anchor_keys_all"]))
        self.dev_curve = [dict(p) for p in state["dev_curve"]]

    def fill(self, report: "TrainReport") -> None:
        """The report's copy of the record (no collection, no dev split: those fields stay absent)."""
        if self.collections:
            report.collections = [dict(c) for c in self.collections]
        report.anchor_keys_all = list(self.anchor_keys_all)
        if self.anchor_keys_all:   # evaluation must avoid every query any collection trained on
            report.anchor_keys = list(self.anchor_keys_all)
        if self.dev_curve:
            report.dev_curve = [dict(p) for p in self.dev_curve]
