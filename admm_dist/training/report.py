"""The training report (``<report_dir>/<name>-train.json``, docs/design.md section 7) as a typed recorder.

Every key the trainer reports is a field here, with its type and meaning; the trainer sets
fields, and :meth:`TrainReport.as_dict` writes those that were set, in this order. The report is
an output only: what a resume needs lives in typed state (:mod:`admm_dist.training.state`), which
the report copies. A field
never set (a run with no dev split has no ``dev_curve``) is absent from the file, which is
what the readers (:mod:`admm_dist.mas.evaluation`, the benchmarks) expect.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional

import torch


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()   # a field not set is not written


@dataclasses.dataclass
class TrainReport:
    config: Dict[str, Any] = UNSET                 # the run's settings (TrainConfig.as_dict)
    # the fit set
    fitset_provenance: str = UNSET                 # "file" or "collected"
    collections: List[Dict[str, Any]] = UNSET      # one stats record per on-policy collection
    anchor_keys_all: List[str] = UNSET             # every query key any collection trained on
    fitset: Optional[str] = UNSET                  # the fitset_cache path (None: collected only)
    fitset_settings_key: str = UNSET
    fitset_settings: Dict[str, Any] = UNSET
    collection: Dict[str, Any] = UNSET             # the stats of the fit set in use
    anchor_keys: List[str] = UNSET                 # the query keys evaluation must not use
    adapted_seats: List[int] = UNSET
    adapted_roles: List[str] = UNSET
    dropped_unclosed_think: int = UNSET
    dropped_unadapted_seats: int = UNSET
    target_composition: List[Dict[str, Any]] = UNSET
    dev_held_out: int = UNSET
    node_sizes: List[int] = UNSET
    empty_nodes: List[int] = UNSET
    # the run
    n_nodes: int = UNSET
    numel: int = UNSET
    basis_hash: str = UNSET
    dev_curve: List[Dict[str, float]] = UNSET      # {"round", "dev_nll"} of the consensus z
    preempted_after_round: int = UNSET
    resumed: Dict[str, Any] = UNSET                # {"after_round", "changed": {key: [then, now]}}
    out_path: str = UNSET                          # the absolute out= (a report belongs to one run)
    rounds: List[Dict[str, Any]] = UNSET           # RoundRecord.as_dict per round
    loss_curve: List[List[float]] = UNSET
    normalized_primal_residual_curve: List[List[float]] = UNSET
    x1_norm_curve: List[float] = UNSET
    comm_bytes_per_round_per_node: List[List[int]] = UNSET
    backend: str = UNSET                           # the communicator's class
    placement: List[List[int]] = UNSET             # the nodes of each rank, in rank order
    memory: Dict[str, List[int]] = UNSET            # per rank: backbone and adapter bytes held, peak RSS
                                                    # at start
    bytes_per_rank: Dict[str, Dict[str, List[int]]] = UNSET   # phase -> sent/recv -> per rank, the whole run
    train_sec: float = UNSET
    delta_w_rel: Any = UNSET                       # float, or one per node when deployed locally
    deploy_required: Optional[str] = UNSET         # "local" or None
    best: Dict[str, float] = UNSET                 # {"round", "dev_nll"} of the -best file

    def is_set(self, name: str) -> bool:
        return getattr(self, name) is not UNSET

    def get(self, name: str, default: Any = None) -> Any:
        value = getattr(self, name)
        return default if value is UNSET else value

    def as_dict(self) -> Dict[str, Any]:
        """The set fields, JSON-ready (non-finite floats become null, tensors lists)."""
        return {f.name: jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not UNSET}


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x
