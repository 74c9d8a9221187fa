"""The data pipeline of a run: which fit set it trains on, checked against its settings, and how
that fit set becomes each node's shard (derive, filter, per seat, deduplicate, dev split,
partition). Collection itself is :mod:`admm_dist.mas.collection`; the trainer calls it.
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from admm_dist import tasks
from admm_dist.core.errors import UserError
from admm_dist.data import derive as dv
from admm_dist.data import fitset as fs
from admm_dist.data import partition as pt
from admm_dist.mas.collection import collect_key
from admm_dist.training.config import TrainConfig
from admm_dist.training.report import TrainReport
from admm_dist.training.state import RunRecord


def file_fingerprint(path: Optional[str]) -> str:
    """First 12 hex digits of a file's sha256 ("none" without a file)."""
    if not path:
        return "none"
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def collect_settings(cfg: TrainConfig) -> Dict[str, object]:
    """The settings a fit set must have been built under to train this run."""
    return {"task": cfg.task, "n_agents": cfg.n_agents, "adapt_roles": cfg.adapt_roles}


def needs_collection(cfg: TrainConfig) -> bool:
    """Collect on-policy unless a fit set is given (or cached from an earlier run)."""
    if cfg.fitset_cache and os.path.exists(cfg.fitset_cache):
        return False
    if cfg.task not in tasks.REGISTRY:
        if cfg.fitset_cache:
            raise UserError(f"--fitset_cache {cfg.fitset_cache} does not exist, and task {cfg.task!r} is not "
                            f"one to collect on-policy from: fix the path, or pass --task one of "
                            f"{', '.join(sorted(tasks.REGISTRY))}")
        raise UserError("no fit set: pass --fitset_cache PATH (a file written by admm_dist.data.fitset, "
                        "tools/build_fitset or an earlier collection), or --task NAME to collect on-policy")
    if cfg.reward == "judge":
        raise UserError("--reward judge needs a judged fit set and "
                        f"{cfg.fitset_cache or 'no --fitset_cache'} does not exist: build it with "
                        "admm_dist.cli.build_fitset + judge_fitset")
    tasks.get(cfg.task)
    return True


def read_fitset(cfg: TrainConfig, report: TrainReport, record: RunRecord) -> fs.FitSet:
    """The fit set of ``fitset_cache``, refused unless it was built under this run's settings."""
    f = fs.load_fitset(cfg.fitset_cache)
    if f.settings.get("sampling_structure") == "on_policy":
        want = collect_key(cfg, init_sha=file_fingerprint(cfg.init_state))
        diff = fs.settings_diff(f.settings, want, ignore=("fit_mode", "collection"))
    else:   # synthetic or built from stored trajectories: the seat layout must match
        diff = fs.settings_diff(f.settings, collect_settings(cfg),
                                ignore=("fit_mode", "sampling_structure", "judge", "judge_fingerprint"))
    if cfg.reward == "judge" and f.settings.get("sampling_structure") == "actual_trajectory" \
            and not f.settings.get("judge_fingerprint"):
        raise UserError(f"{cfg.fitset_cache} carries no judge labels: run admm_dist.cli.judge_fitset on it "
                        "first")
    if diff:
        raise UserError(f"--fitset_cache {cfg.fitset_cache} was built with different settings "
                        f"(file, requested): {diff}; collect again (remove the file) or match them")
    report.fitset_provenance = "file"
    record.add_anchor_keys(list(f.anchor_keys))   # re-collections add theirs: evaluation must avoid all
    return f


def shard(cfg: TrainConfig, f: fs.FitSet, nodes: Sequence[int], report: TrainReport,
          talk: Callable[[str], None], *, hold_out: bool = True
          ) -> Tuple[Dict[int, List[fs.Example]], List[fs.Example]]:
    """This rank's nodes' training examples and the held-out dev examples of fit set ``f``:
    derived for ``fit_mode``, filtered, per seat, deduplicated, dev split (``dev_frac``, when
    ``hold_out``: the first fit set of a run; a re-collection's trains on all its examples, so
    that the held-out NLL of every round is measured on one set), partitioned."""
    examples = dv.derive(f, cfg.fit_mode)
    seats = cfg.adapted_seats()
    report.fitset = cfg.fitset_cache
    report.fitset_settings_key = fs.settings_key(f.settings)
    report.fitset_settings = f.settings
    report.collection = f.stats
    report.anchor_keys = list(f.anchor_keys)   # until the record's (RunRecord.fill) names every collection's
    report.adapted_seats = seats
    report.adapted_roles = [cfg.role(s) for s in seats]
    if cfg.fit_filter == "drop_unclosed_think":
        examples, dropped = dv.drop_unclosed_think(examples)
        report.dropped_unclosed_think = dropped
    outside = sorted({e.seat for e in examples if not 0 <= e.seat < cfg.n_agents})
    if outside:
        raise UserError(f"{cfg.fitset_cache or 'the fit set'} holds examples of seat(s) {outside}, outside "
                        f"the chain of n_agents={cfg.n_agents} seats (0..{cfg.n_agents - 1}): rebuild it for "
                        "this chain, or set n_agents to the chain it was built for")
    others = sum(1 for e in examples if e.seat not in seats)
    if others:   # seats this run does not adapt (adapt_roles): documented, and said once
        report.dropped_unadapted_seats = others
        talk(f"note: {others} examples belong to seats this run does not adapt (adapt_roles="
                  f"{cfg.adapt_roles}): not trained on")
    per_seat = pt.by_seat(examples, seats, drop_others=True)
    if cfg.dedup_targets > 0 and cfg.fit_mode != "grpo":   # grpo: a group's repeats are its samples
        flat = dv.dedup_targets([e for s in per_seat for e in s], cfg.dedup_targets)
        per_seat = pt.by_seat(flat, seats)
    report.target_composition = dv.target_composition(per_seat)
    dev: List = []
    if cfg.dev_frac > 0 and hold_out:
        per_seat, dev = pt.split_dev(per_seat, cfg.dev_frac, cfg.seed)
        report.dev_held_out = len(dev)
        if cfg.recollect_every:
            talk("note: dev_frac with recollect_every: -best is the round with the lowest NLL on the first "
                 "collection's held-out examples, which later collections move away from (on the stand-in "
                 "it was an early round and 17 points below -last: docs/benchmarks.md); deploy -last")
    parts = pt.partition(per_seat, mode=cfg.partition, n_partitions=cfg.n_partitions,
                         pooled=cfg.pooled)
    report.node_sizes = [len(p) for p in parts]
    if not any(parts):
        raise UserError(f"no training examples in {cfg.fitset_cache or 'the collected fit set'} for "
                        f"seats {seats}: refusing to train (with on-policy collection: more --anchors, "
                        "a larger --group or a wider --anchor_pass_band)")
    empty = [i for i, p in enumerate(parts) if len(p) == 0]
    if empty and cfg.empty_nodes == "error":
        raise UserError(f"node(s) {empty} have no training examples: adapt fewer roles "
                        "(--adapt_roles), use --pooled, or --empty_nodes prox (such a node "
                        "has f_i = 0 and only follows the consensus)")
    report.empty_nodes = empty
    small = [i for i, p in enumerate(parts) if 0 < len(p) < cfg.batch_size]
    if small:
        talk(f"note: node(s) {small} hold fewer examples ({[len(parts[i]) for i in small]}) than "
                  f"batch_size={cfg.batch_size}: each of their steps uses the whole shard")
    talk(f"fit set {cfg.fitset_cache or '(collected)'}: examples per node {[len(p) for p in parts]}"
         + (f", {len(dev)} held out to measure the held-out NLL each round (dev_frac={cfg.dev_frac:g})"
            if hold_out and cfg.dev_frac else "")
         + (f"; node(s) {', '.join(map(str, empty))} have none, so f_i = 0 (shown as f=-): they move by the "
            "proximal term and consensus alone (empty_nodes=prox)" if empty else ""))
    return {n: parts[n] for n in nodes}, dev


def check_context(cfg: TrainConfig, model, enc) -> None:
    """An example longer than the backbone's positions is refused, naming the lengths."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return
    longest = max(len(p) + len(t) for e in enc for p, t, _, _ in e.rows())
    if longest > positions:
        raise UserError(f"an example is {longest} tokens (prompt + target) but {cfg.model_name} has "
                        f"{positions} positions (max_position_embeddings): lower max_prompt_tokens "
                        f"(now {cfg.max_prompt_tokens}) or max_target_tokens (now "
                        f"{cfg.max_target_tokens})")

