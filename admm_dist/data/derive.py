"""From a loaded fit set to the examples one objective trains on: derivation and filters.

This module owns :func:`derive` (the ``sft``, ``rsft``, ``dpo`` or ``grpo`` examples of a fit set,
including the DPO pairing rule and GRPO's group advantages, :func:`grpo_examples`) and the filters
that run on them before the node assignment (:mod:`admm_dist.data.partition`):
:func:`drop_unclosed_think`, :func:`dedup_targets` and the :func:`target_composition` report. A
target's *visible* text, which the dedup and the report compare, is
:func:`admm_dist.core.text.visible` (the text after the last ``</think>``), stripped.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from admm_dist.core.text import THINK_CLOSE, THINK_OPEN, is_int, visible
from admm_dist.data.fitset import DERIVED_MODES, Example, FitSet, FitSetError, check_mode

FIT_FILTERS = ("none", "drop_unclosed_think")   # fit_filter: what is dropped before training
ADVANTAGE_EPS = 1e-4   # grpo: (reward - group mean) / (group std + this), TRL's GRPOTrainer's


def derive(fs: FitSet, fit_mode: str, *, pair_by: Optional[str] = None) -> List[Example]:
    """The ``fit_mode`` examples of ``fs`` as new objects (``fs`` is not changed).

    From an ``sft`` fit set:
      * ``sft``  -- every message;
      * ``rsft`` -- messages whose rollout succeeded (``success is True``);
      * ``dpo``  -- pairs built per group of messages that share (seat, anchor, prompt), i.e.
        alternatives sampled at one branch point. Pairing rule: in each group (groups in
        order of first appearance) let S be the successful messages and F the failed ones
        (``success is False``; unlabelled messages are not paired), each in file order.
        If both are non-empty, pair i = (S[i % |S|], F[i % |F|]) for i < max(|S|, |F|):
        every labelled message is used, no pair repeats, and a group gives at most
        max(|S|, |F|) pairs instead of |S|*|F|. Pairs whose two texts are identical are
        skipped (they carry no preference). A pair takes the chosen message's seat, role,
        anchor, prompt, reward and node, ``rejected_reward`` = the failed message's reward,
        ``advantage`` = chosen.advantage - rejected.advantage (the preference margin),
        ``success`` = None.
      * ``grpo`` -- every message, its ``advantage`` its reward normalised in its group
        (:func:`grpo_examples`); messages of groups whose rewards are all equal are dropped.
    From a ``dpo`` fit set only ``dpo`` (the pairs themselves).
    """
    check_mode(fit_mode, DERIVED_MODES, "fit_mode")
    src = fs.fit_mode
    if src == "dpo" and fit_mode == "dpo":
        return [dataclasses.replace(ex) for ex in fs.examples]
    if src != "sft":
        raise FitSetError(f"cannot derive {fit_mode!r} examples from a {src!r} fit set: "
                          f"collect with fit_mode sft (or {fit_mode}) instead")
    if fit_mode == "sft":
        return [dataclasses.replace(ex) for ex in fs.examples]
    if fit_mode == "grpo":
        return grpo_examples(fs)[0]
    if fs.examples and all(ex.success is None for ex in fs.examples):
        raise FitSetError(f"cannot derive {fit_mode!r} examples: the sft fit set carries no "
                          f"success labels; collect with a success-labelled reward")
    if fit_mode == "rsft":
        return [dataclasses.replace(ex) for ex in fs.examples if ex.success is True]

    if pair_by is None:
        pair_by = "anchor" if (fs.settings.get("credit") == "shared" or
                               fs.settings.get("sampling_structure") == "actual_trajectory") else "prompt"
    if pair_by not in ("prompt", "anchor"):
        raise FitSetError(f"pair_by={pair_by!r}: use prompt or anchor")
    groups: Dict[Tuple[int, str, str], Tuple[List[Example], List[Example]]] = {}
    for ex in fs.examples:
        key = (ex.seat, ex.anchor, ex.prompt if pair_by == "prompt" else "")
        good, bad = groups.setdefault(key, ([], []))
        if ex.success is True:
            good.append(ex)
        elif ex.success is False:
            bad.append(ex)
    pairs = []
    for good, bad in groups.values():
        if not good or not bad:
            continue
        for i in range(max(len(good), len(bad))):
            c, r = good[i % len(good)], bad[i % len(bad)]
            if c.target == r.target:
                continue
            pairs.append(Example(seat=c.seat, role=c.role, anchor=c.anchor, prompt=c.prompt,
                                 target=c.target, rejected=r.target,
                                 rejected_prompt=None if r.prompt == c.prompt else r.prompt,
                                 reward=c.reward, rejected_reward=r.reward,
                                 advantage=c.advantage - r.advantage, success=None,
                                 node=c.node))
    return pairs


def grpo_examples(fs: FitSet) -> Tuple[List[Example], Dict[str, int]]:
    """GRPO's examples of an on-policy ``sft`` fit set, and the count of its groups
    (:func:`advantages`)."""
    if fs.fit_mode != "sft":
        raise FitSetError(f"cannot derive 'grpo' examples from a {fs.fit_mode!r} fit set: collect with "
                          f"fit_mode sft (every sampled message, with its reward)")
    if fs.settings.get("sampling_structure") != "on_policy":
        raise FitSetError("fit_mode grpo learns from messages the chain sampled itself: this fit set "
                          f"is {fs.settings.get('sampling_structure') or 'not collected on-policy'}; "
                          "collect on-policy (--task, without --fitset_cache)")
    return advantages(fs.examples)


def advantages(examples: Sequence[Example]) -> Tuple[List[Example], Dict[str, int]]:
    """The messages of ``examples`` with their group advantages (new objects, in order), and
    ``{"groups": n, "zero_spread": m}``.

    A group is one seat's messages for one query (``seat``, ``anchor``): under ``credit shared``
    the seat's messages in the query's ``group`` chains, under ``per_role`` the seat's ``group``
    branches from one prefix. Groups are per seat, so each seat's advantages are normalised
    among its own messages (Dr. MAS's per-agent normalisation). A message's ``advantage`` is
    ``(reward - mean) / (std + ADVANTAGE_EPS)`` over its group (``std`` with Bessel's correction,
    as TRL's ``GRPOTrainer``). A group whose rewards are all equal (or of one message) has
    no advantage to give: its messages are dropped, and counted in ``zero_spread``."""
    groups: Dict[Tuple[int, str], List[Example]] = {}
    for ex in examples:
        groups.setdefault((ex.seat, ex.anchor), []).append(ex)
    out: Dict[int, Example] = {}
    flat = 0
    for members in groups.values():
        rewards = [ex.reward for ex in members]
        mean = sum(rewards) / len(rewards)
        n = len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
        if std == 0.0:
            flat += 1
            continue
        for ex in members:
            out[id(ex)] = dataclasses.replace(ex, advantage=(ex.reward - mean) / (std + ADVANTAGE_EPS))
    kept = [out[id(ex)] for ex in examples if id(ex) in out]   # in order
    return kept, {"groups": len(groups), "zero_spread": flat}


# ----------------------------------------------------------------------------- filters

def _unclosed(t: Optional[str]) -> bool:
    if t is None:
        return False
    i = t.rfind(THINK_OPEN)
    return i >= 0 and t.find(THINK_CLOSE, i + len(THINK_OPEN)) < 0


def drop_unclosed_think(examples: Iterable[Example]) -> Tuple[List[Example], int]:
    """Drop examples whose target or rejected text opens a ``<think>`` block that no later
    ``</think>`` closes (a message cut off mid-reasoning). Returns (kept, n_dropped)."""
    kept, dropped = [], 0
    for ex in examples:
        if _unclosed(ex.target) or _unclosed(ex.rejected):
            dropped += 1
        else:
            kept.append(ex)
    return kept, dropped


def dedup_targets(examples: Sequence[Example], cap: int) -> List[Example]:
    """Per node (examples grouped by ``node`` when it is set (>= 0), else by ``seat``), keep
    at most ``cap`` examples with one visible target text (``visible(target).strip()``, the
    text after the last ``</think>``): the highest-``advantage`` ones (ties: the earlier one),
    returned in their original order. ``cap`` 0 turns this off."""
    if not is_int(cap) or cap < 0:
        raise FitSetError(f"dedup_targets cap must be an integer >= 0 (0 = off), got {cap!r}")
    examples = list(examples)
    if cap == 0:
        return examples
    order = sorted(range(len(examples)), key=lambda i: -examples[i].advantage)  # stable
    seen: Dict[Tuple[str, int, str], int] = {}
    keep = set()
    for i in order:
        ex = examples[i]
        where = ("node", ex.node) if ex.node >= 0 else ("seat", ex.seat)
        key = where + (visible(ex.target).strip(),)
        if seen.get(key, 0) < cap:
            seen[key] = seen.get(key, 0) + 1
            keep.add(i)
    return [ex for i, ex in enumerate(examples) if i in keep]


def target_composition(per_node: Sequence[Sequence[Example]]) -> List[Dict[str, Any]]:
    """Per node: n examples, distinct visible targets, and the share of the most common one
    (rounded to 4 places; 0 for an empty node)."""
    out = []
    for node, fset in enumerate(per_node):
        counts: Dict[str, int] = {}
        for ex in fset:
            t = visible(ex.target).strip()
            counts[t] = counts.get(t, 0) + 1
        top = max(counts.values()) if counts else 0
        out.append({"node": node, "n": len(fset), "distinct": len(counts),
                    "top_share": round(top / max(1, len(fset)), 4)})
    return out

