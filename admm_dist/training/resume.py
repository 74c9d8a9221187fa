"""Saving a round and resuming from the last round every rank completed.

A checkpoint is written from the objects that own the run's state, each through its
``state_dict()`` (:class:`Checkpointed`): the engine (per node x, z, u and the public copies of
compressed consensus; the round, rho and history), each node's optimizer and sampler, the run's
record (:class:`~admm_dist.training.state.RunRecord`), the best round, the states the last
re-collection ran under, and the CPU RNG state. A resume loads the files
(:mod:`admm_dist.training.checkpoint`) and restores each object through ``load_state_dict()``, so
a resumed run continues bit for bit as if it had not stopped. The report is not read back.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from admm_dist.training import checkpoint as ckpt
from admm_dist.training.checkpoint import CheckpointError
from admm_dist.training.config import RESUMABLE, TrainConfig
from admm_dist.training.report import TrainReport
from admm_dist.training.state import BestRound, NodeState, RunRecord

ADAM = "adam."         # tensor-name prefix of the optimizer's per-parameter state
ENGINE = ("x", "z", "u")   # the engine's per-node tensors (and its "comm.*" state)
COLLECTED_UNDER = "collected_under"   # the node's deployed state at the last re-collection
BEST_Z = "best_z"

if TYPE_CHECKING:
    from admm_dist.engine.admm import ADMMEngine
    from admm_dist.engine.control import Control


@dataclasses.dataclass
class Checkpointed:
    """What a checkpoint is written from and restored into: the objects that own the run's state."""
    engine: "ADMMEngine"
    nodes: Dict[int, NodeState]
    record: RunRecord
    best: Optional[BestRound] = None
    collected_under: Optional[Sequence[torch.Tensor]] = None   # per local node, once the run collected again

    def node_files(self, node: int, engine_state: Mapping[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict]:
        """Node ``node``'s tensors and JSON state."""
        st = self.nodes[node]
        adam_tensors, adam_scalars = optimizer_record(st.optimizer)
        tensors = {**engine_state["nodes"][node], **adam_tensors, "rng_cpu": torch.get_rng_state()}
        if self.best is not None:
            tensors[BEST_Z] = self.best.z
        if self.collected_under is not None:
            tensors[COLLECTED_UNDER] = self.collected_under[list(self.nodes).index(node)]
        meta = {"engine": {k: engine_state[k] for k in ("round", "rho", "history")},
                "adam": adam_scalars, "sampler": st.sampler.state_dict() if st.sampler else None,
                "sampling": st.sampling,
                "record": self.record.state_dict(),
                "best": None if self.best is None else {k: v for k, v in self.best.state_dict().items()
                                                        if k != "z"}}
        return tensors, meta


def save_round(root: str, run: Checkpointed, control: "Control", *, fingerprint: str,
               identity: Mapping[str, Any], resumable: Mapping[str, float], keep: int,
               writer: bool = True) -> None:
    """Every node of this rank writes round ``engine.round``; then the ranks agree on the newest
    round all of them completed, and only then prune to ``keep`` rounds up to it. A rank that is
    not its seat group's leader (``writer`` false) writes nothing and only takes part in that
    agreement (its leader writes the same state).

    A rank killed while writing leaves the others waiting in that agreement (they fail with the
    dead peer), so no rank ever prunes the last round every rank completed."""
    nodes = list(run.nodes)
    k = run.engine.round
    if not writer:
        control.min(k)
        return
    engine_state = run.engine.state_dict()
    before = [r for r in ckpt.completed_rounds(root, nodes, fingerprint) if r < k]
    for node in nodes:
        tensors, meta = run.node_files(node, engine_state)
        meta.update(fingerprint=fingerprint, resumable=dict(resumable),
                    # what the fingerprint hashes: a refused resume names the difference
                    identity=dict(identity),
                    previous=before[-1] if before else 0)   # every node must hold it or this one
        ckpt.save_node(root, k, node, tensors, meta)
    mine = ckpt.completed_rounds(root, nodes, fingerprint)
    ckpt.prune(root, nodes, keep, fingerprint, upto=control.min(mine[-1] if mine else 0))


def optimizer_record(optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """The optimizer's ``state_dict()`` state of its one parameter (the flat B vector), split for a
    checkpoint: its tensors, named ``adam.<key>``, and its scalars (Adam's step). The parameter
    groups (the learning rate and the rest) are the run's settings, not state: not saved."""
    state = optimizer.state_dict()["state"]
    if len(state) > 1:
        raise ValueError(f"the optimizer holds state for {len(state)} parameters; "
                         f"one (the flat B vector) expected")
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


def agreed_round(cfg: TrainConfig, control: "Control", nodes: Sequence[int], fingerprint: str,
                 identity: Mapping[str, Any], talk: Callable[[str], None] = lambda m: None) -> int:
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
        raise CheckpointError(f"resume auto: round {agreed} is the last every rank completed but the files "
                              f"of node(s) {list(nodes)} for it are gone from "
                              f"{ckpt.round_dir(root, agreed)}: "
                              "restore them, or start again with overwrite=true")
    return agreed


def restore_round(cfg: TrainConfig, agreed: int, run: Checkpointed, *, fingerprint: str, device,
                  report: TrainReport, recollect: Callable[..., None]) -> None:
    """Load round ``agreed`` into ``run``'s objects (the best round too). With ``recollect_every``,
    the last re-collection before ``agreed`` is made again, under the states it ran under (kept in
    the checkpoint), which gives the same rollouts."""
    root = ckpt.ckpt_root(cfg.out)
    where = ckpt.round_dir(root, agreed)
    loaded = {node: ckpt.load_node(root, agreed, node, fingerprint) for node in run.nodes}
    first = next(iter(loaded.values()))[1]
    engine_state = dict(first["engine"], nodes={
        node: {k: t.to(device) for k, t in tensors.items() if k in ENGINE or k.startswith("comm.")}
        for node, (tensors, _) in loaded.items()})
    try:
        run.engine.load_state_dict(engine_state)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {where} does not fit this run ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}): delete that round folder to "
                              "resume from the one before") from None
    every = cfg.recollect_every
    again = agreed // every if every and every <= agreed < cfg.k_outer else None   # the collection made again
    run.record.load_state_dict(first["record"], before_collection=again)
    if again is not None:
        kept = [tensors.get(COLLECTED_UNDER) for tensors, _ in loaded.values()]
        if any(v is None for v in kept):
            raise CheckpointError(f"checkpoint {where} lacks the states of collection {again}: the file is "
                                  "damaged or from another version; delete that round folder to resume from "
                                  "the one before")
        recollect(again, [v.to(device) for v in kept])
        for node, (_, meta) in loaded.items():   # grpo: the ratio's denominator must be the one trained on
            if meta.get("sampling") != run.nodes[node].sampling:
                raise CheckpointError(f"checkpoint {where}/node-{node}: collection {again}, made again under "
                                      "the states it kept, gives other sampling log-probs than the run "
                                      "trained on (the backbone, the code or the machine changed): "
                                      "resume=never starts over")
    for node, (tensors, meta) in loaded.items():
        st = run.nodes[node]
        try:
            load_optimizer(st.optimizer, tensors, meta["adam"], device)
            if st.sampler is not None and meta["sampler"] is not None:
                st.sampler.load_state_dict(meta["sampler"])
            torch.set_rng_state(tensors["rng_cpu"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {where}/node-{node} does not fit this run "
                                  f"({type(e).__name__}): "
                                  "delete that round folder to resume from the one before") from None
        if meta["best"] is not None:
            run.best = BestRound.from_state_dict(dict(meta["best"], z=tensors[BEST_Z].to(device)))
    ckpt.prune(root, list(run.nodes), cfg.keep_checkpoints, fingerprint, upto=agreed)   # every rank has it
    then = first["resumable"]
    report.resumed = {"after_round": agreed,
                      "changed": {k: [then[k], getattr(cfg, k)] for k in RESUMABLE
                                  if k in then and then[k] != getattr(cfg, k)}}
