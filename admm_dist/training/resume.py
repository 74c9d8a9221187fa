"""Saving a round and resuming from the last round every rank completed.

A checkpoint of round k holds, per node, x, z, u, the public copies of compressed consensus
(``comm.*``), the Adam moments, the CPU RNG state, the sampler's position, the round history,
the dev curve, the adaptive rho, the best round and, once the run has collected again
(``recollect_every``), the node's state that collection ran under (files:
:mod:`admm_dist.training.checkpoint`). Resuming restores exactly that, so a resumed run
continues bit for bit as if it had not stopped.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from admm_dist.engine.admm import RoundRecord
from admm_dist.training import checkpoint as ckpt
from admm_dist.training.checkpoint import CheckpointError
from admm_dist.training.config import RESUMABLE, TrainConfig
from admm_dist.training.report import TrainReport
from admm_dist.training.state import BestRound, NodeState

COMM_STATE = "comm."   # tensor-name prefix of the communicator's per-node state
ADAM = "adam."         # tensor-name prefix of the optimizer's per-parameter state
COLLECTED_UNDER = "collected_under"   # the node's deployed state at the last re-collection

if TYPE_CHECKING:
    from admm_dist.engine.admm import ADMMEngine
    from admm_dist.engine.control import Control
    from admm_dist.testing.faults import FaultPlan


def save_round(root: str, *, engine: "ADMMEngine", control: "Control", nodes: Sequence[int],
               state: Dict[int, NodeState], fingerprint: str, report: TrainReport,
               best: Optional[BestRound], keep: int, resumable: Dict[str, float], identity: Mapping[str, Any],
               collected_under: Optional[Sequence[torch.Tensor]] = None,
               faults: Optional["FaultPlan"] = None) -> None:
    """Every node of this rank writes round ``engine.round``; then the ranks agree on the newest
    round all of them completed, and only then prune to ``keep`` rounds up to it.

    A rank killed while writing leaves the others waiting in that agreement (they fail with the
    dead peer), so no rank ever prunes the last round every rank completed."""
    k = engine.round
    history = [r.as_dict() for r in engine.history]
    before = [r for r in ckpt.completed_rounds(root, nodes, fingerprint) if r < k]
    for j, node in enumerate(nodes):
        st = state[node]
        tensors = {"x": engine.x[j], "z": engine.z[j], "u": engine.u[j], "rng_cpu": torch.get_rng_state()}
        # compressed consensus: the node's public copies (admm_dist/engine/comm/compressed.py)
        tensors.update({f"{COMM_STATE}{name}": t for name, t in engine.comm.node_state(node).items()})
        adam_tensors, adam_scalars = optimizer_record(st.optimizer)
        tensors.update(adam_tensors)
        meta = {"fingerprint": fingerprint,
                "adam": adam_scalars,
                "sampler": st.sampler.state_dict() if st.sampler else None, "history": history,
                "dev_curve": report.get("dev_curve", []),
                # what the report says of the collections so far (a resume makes only the last again)
                "collections": report.get("collections", []),
                "anchor_keys_all": report.get("anchor_keys_all", []),
                "rho": engine.state_dict()["rho"],
                "best": None if best is None else best.meta(),
                "resumable": dict(resumable),
                # what the fingerprint hashes, so a refused resume can name the setting that differs
                "identity": dict(identity),
                # the checkpoint before this one: every node must hold it or this one
                "previous": before[-1] if before else 0}
        if best is not None:
            tensors["best_z"] = best.z
        if collected_under is not None:      # the state the last re-collection ran under
            tensors[COLLECTED_UNDER] = collected_under[j]
        ckpt.save_node(root, k, node, tensors, meta,   # faults: tests only, a kill inside this write
                       hook=None if faults is None else (lambda point, n=node: faults.in_checkpoint(k, n, point)))
    mine = ckpt.completed_rounds(root, nodes, fingerprint)
    ckpt.prune(root, nodes, keep, fingerprint, upto=control.min(mine[-1] if mine else 0))


def optimizer_record(optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """The optimizer's ``state_dict()`` state of its one parameter (the flat B vector), split for a
    checkpoint: its tensors, named ``adam.<key>``, and its scalars (Adam's step). The parameter
    groups (the learning rate and the rest) are the run's settings, not state: not saved."""
    state = optimizer.state_dict()["state"]
    if len(state) > 1:
        raise ValueError(f"the optimizer holds state for {len(state)} parameters; one (the flat B vector) expected")
    own = next(iter(state.values()), {})
    tensors = {ADAM + k: v for k, v in own.items() if torch.is_tensor(v) and v.dim() > 0}
    scalars = {k: float(v) for k, v in own.items() if ADAM + k not in tensors}
    return tensors, scalars


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor],
                   scalars: Mapping[str, float], device) -> None:
    """Put a checkpoint's :func:`optimizer_record` back through ``load_state_dict``, under the
    optimizer's current parameter groups (``eta`` may change on resume); a node that never
    stepped has no state to load."""
    state = {k[len(ADAM):]: t.to(device, copy=True) for k, t in tensors.items() if k.startswith(ADAM)}
    if not state:
        return
    state.update({k: torch.tensor(float(v)) for k, v in scalars.items()})
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": {0: state}, "param_groups": current["param_groups"]})


def differences(then: Mapping[str, Any], now: Mapping[str, Any]) -> List[str]:
    """What differs between two runs' identities (:meth:`TrainConfig.semantic` and the content
    digests), as ``key there -> here`` phrases; empty when ``then`` records nothing."""
    if not isinstance(then, Mapping) or not isinstance(then.get("settings"), Mapping):
        return []
    out = []
    a, b = then["settings"], now["settings"]
    for k in sorted(set(a) | set(b)):
        if a.get(k, "unset") != b.get(k, "unset"):
            out.append(f"{k} {a.get(k, 'unset')!r} there, {b.get(k, 'unset')!r} here")
    for k, what in (("fitset", "the fit set's content"), ("init_state", "init_state's content")):
        if then.get(k) != now.get(k):
            out.append(f"{what} differs")
    return out


def _foreign_differences(root: str, fingerprint: str, identity: Mapping[str, Any]) -> str:
    """Which settings the newest foreign checkpoint of ``root`` differs in, as a clause."""
    for k in reversed(ckpt.all_rounds(root)):
        folder = ckpt.round_dir(root, k)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if not (name.startswith("node-") and name.endswith(".json")):
                continue
            meta = ckpt.read_marker(os.path.join(folder, name))
            if meta is None or meta.get("fingerprint") == fingerprint:
                continue
            diff = differences(meta.get("identity"), identity)
            if diff:
                shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
                return f" (it differs in {shown})"
            return " (its checkpoints do not record which setting differs)"
    return ""


def agreed_round(cfg: TrainConfig, control: "Control", nodes: Sequence[int], rank: int,
                 fingerprint: str, identity: Mapping[str, Any],
                 talk: Callable[[str], None] = lambda m: None) -> int:
    """The last round every rank completed under this run's fingerprint (0: none)."""
    root = ckpt.ckpt_root(cfg.out)
    for k in ckpt.all_rounds(root):    # temporaries of a killed write: never read, removed now
        ckpt.remove_orphans(ckpt.round_dir(root, k), nodes)
    for path in ckpt.misplaced(root, nodes):
        talk(f"resume auto: {path} names another round or node than its place (copied from elsewhere): "
             "not used; its round counts as incomplete")
    mine = ckpt.completed_rounds(root, nodes, fingerprint)
    newest_of, previous = {}, 0   # per node: its newest round; the checkpoint such a round followed
    for node in nodes:
        own = ckpt.completed_rounds(root, [node], fingerprint)
        newest_of[node] = own[-1] if own else 0
        previous = max(previous, ckpt.previous_of(root, own[-1], node) if own else 0)
    agreed, newest = control.min(min(newest_of.values())), control.max(max(newest_of.values()))
    required = control.max(previous)
    foreign = control.any(bool(ckpt.foreign_rounds(root, fingerprint)))
    missing = control.nodes_where({node: r < required for node, r in newest_of.items()})
    if missing:
        raise CheckpointError(
            f"resume auto: the checkpoints in {root} lack node(s) {missing}: the other nodes hold round "
            f"{newest}, written after round {required}, which every node must hold; restore the missing "
            "node files (node-<i>.json and .safetensors), or start again with overwrite=true")
    if foreign and agreed == 0:
        raise CheckpointError(
            f"resume auto: the checkpoints in {root} were written by another run (other settings, fit set "
            f"or initial state){_foreign_differences(root, fingerprint, identity)}: resume with that run's "
            "settings, replace it with overwrite=true (resume=never), or choose a new out=")
    if newest > cfg.k_outer:
        raise CheckpointError(
            f"resume auto: the checkpoints in {root} reach round {newest}, beyond k_outer={cfg.k_outer}: "
            f"pass k_outer={newest} or more to continue that run, or choose a new out=")
    if agreed and agreed not in mine:
        raise CheckpointError(f"resume auto: round {agreed} is the last every rank completed but the files of "
                              f"node(s) {list(nodes)} for it are gone from {ckpt.round_dir(root, agreed)}: "
                              "restore them, or start again with overwrite=true")
    return agreed


def restore_collections(report: TrainReport, meta: Dict, upto: Optional[int]) -> None:
    """The report's record of the collections before collection ``upto`` (the one the resume
    makes again; all of them when None) and of every query trained on, from a checkpoint's meta
    (empty in a run that has not collected yet: the report keeps what this attempt collected)."""
    if meta["collections"]:
        report.collections = [c for c in meta["collections"] if upto is None or c.get("collection", 0) < upto]
    if meta["anchor_keys_all"]:
        report.anchor_keys_all = []
        report.add_anchor_keys(list(meta["anchor_keys_all"]))
        report.anchor_keys = list(report.anchor_keys_all)


def restore_round(cfg: TrainConfig, agreed: int, *, engine: "ADMMEngine", nodes: Sequence[int],
                  state: Dict[int, NodeState], fingerprint: str, device,
                  report: TrainReport, recollect: Callable[..., None]) -> Optional[BestRound]:
    """Load round ``agreed`` into the engine, the optimisers and the samplers; the best round.
    With ``recollect_every``, the last re-collection before ``agreed`` is made again, under the
    states it ran under (kept in the checkpoint), which gives the same rollouts."""
    root = ckpt.ckpt_root(cfg.out)
    restored: Dict[str, object] = {"round": agreed}
    loaded = {}
    for node in nodes:
        tensors, meta = ckpt.load_node(root, agreed, node, fingerprint)
        loaded[node] = (tensors, meta)
        restored["rho"] = meta["rho"]
        for name in ("x", "z", "u"):
            restored[f"{name}.{node}"] = tensors[name].to(device)
    where = f"{ckpt.round_dir(root, agreed)}"
    for node, (tensors, _) in loaded.items():
        public = {k[len(COMM_STATE):]: t.to(device) for k, t in tensors.items() if k.startswith(COMM_STATE)}
        if engine.comm.compress != "none" and not public:
            raise CheckpointError(f"checkpoint {where}/node-{node} lacks the public copies of compress="
                                  f"{engine.comm.compress}: delete that round folder to resume from the one before")
        engine.comm.load_node_state(node, public)
    try:
        engine.load_state_dict(restored)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {where} does not fit this run ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}): delete that round folder to "
                              "resume from the one before") from None
    every = cfg.recollect_every
    again = agreed // every if every and every <= agreed < cfg.k_outer else None   # the collection made again
    restore_collections(report, loaded[nodes[0]][1], again)
    if again is not None:
        kept = [loaded[node][0].get(COLLECTED_UNDER) for node in nodes]
        if any(v is None for v in kept):
            raise CheckpointError(f"checkpoint {where} lacks the states of collection {again}: the file is damaged "
                                  "or from another version; delete that round folder to resume from the one before")
        recollect(again, [v.to(device) for v in kept])
    best: Optional[BestRound] = None
    for node, (tensors, meta) in loaded.items():
        st = state[node]
        try:
            load_optimizer(st.optimizer, tensors, meta["adam"], device)
            if st.sampler is not None and meta["sampler"] is not None:
                st.sampler.load_state_dict(meta["sampler"])
            torch.set_rng_state(tensors["rng_cpu"])
            engine.history = [RoundRecord(**r) for r in meta["history"]]
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {where}/node-{node} does not fit this run ({type(e).__name__}): "
                                  "delete that round folder to resume from the one before") from None
        if meta.get("dev_curve"):
            report.dev_curve = meta["dev_curve"]
        if meta.get("best") is not None:
            best = BestRound(meta["best"][0], meta["best"][1], tensors["best_z"].to(device))
    ckpt.prune(root, nodes, cfg.keep_checkpoints, fingerprint, upto=agreed)   # agreed: every rank has it
    then = loaded[nodes[0]][1]["resumable"]
    report.resumed = {"after_round": agreed,
                      "changed": {k: [then[k], getattr(cfg, k)] for k in RESUMABLE
                                  if k in then and then[k] != getattr(cfg, k)}}
    return best
