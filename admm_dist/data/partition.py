"""The node assignment: which training node holds which example, and the dev hold-out.

This module owns :func:`by_seat` (one list per adapted seat), :func:`split_dev` (the dev
examples held out of every node), :func:`anchor_node` (the stable node of a query key) and
:func:`partition` (seat, anchor or pooled), which sets every example's ``node``. It runs after
the filters of :mod:`admm_dist.data.derive`.
"""
from __future__ import annotations

import hashlib
import random
from typing import Dict, Iterable, List, Sequence, Tuple

from admm_dist.core.constants import DEV_SPLIT_SALT
from admm_dist.core.text import is_int
from admm_dist.data.fitset import PARTITION_MODES, Example, FitSetError, check_mode


def split_dev(per_node: Sequence[Sequence[Example]], frac: float,
              seed: int) -> Tuple[List[List[Example]], List[Example]]:
    """Hold out ``round(len * frac)`` examples of every node (before any pooling, so every
    node contributes), chosen by one ``random.Random(seed ^ DEV_SPLIT_SALT)`` shuffling the nodes'
    indices in turn. Returns (train_per_node, dev_examples); both keep the original order."""
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
        raise FitSetError(f"dev_frac must lie in [0, 1), got {frac!r}")
    if not is_int(seed):
        raise FitSetError(f"split_dev seed must be an integer, got {seed!r}")
    if frac == 0:
        return [list(f) for f in per_node], []
    rng = random.Random(seed ^ DEV_SPLIT_SALT)
    train, dev = [], []
    for fset in per_node:
        fset = list(fset)
        idx = list(range(len(fset)))
        rng.shuffle(idx)
        held = set(idx[: int(round(len(fset) * frac))])
        dev.extend(fset[i] for i in sorted(held))
        train.append([ex for i, ex in enumerate(fset) if i not in held])
    return train, dev


def by_seat(examples: Iterable[Example], seats: Sequence[int], *,
            drop_others: bool = False) -> List[List[Example]]:
    """Node j gets the examples of seat ``seats[j]`` (in order). Examples of seats not listed
    are an error unless ``drop_others``."""
    seats = list(seats)
    if len(set(seats)) != len(seats):
        raise FitSetError(f"by_seat: seats {seats} list a seat twice; give each seat once")
    where = {s: j for j, s in enumerate(seats)}
    out: List[List[Example]] = [[] for _ in seats]
    others: Dict[int, int] = {}
    for ex in examples:
        j = where.get(ex.seat)
        if j is None:
            others[ex.seat] = others.get(ex.seat, 0) + 1
        else:
            out[j].append(ex)
    if others and not drop_others:
        raise FitSetError(f"fit set holds examples of seats {sorted(others)} (counts "
                          f"{others}) that are not adapted seats {seats}: fix adapt_roles/"
                          f"n_agents to match the fit set, or drop them explicitly")
    return out


def anchor_node(anchor: str, n_partitions: int) -> int:
    """The node an anchor belongs to: sha1 of its key mod ``n_partitions`` (stable across
    processes and runs, unlike ``hash()``)."""
    return int(hashlib.sha1(str(anchor).encode("utf-8")).hexdigest(), 16) % n_partitions


def partition(per_seat: Sequence[Sequence[Example]], *, mode: str = "seat",
              n_partitions: int = 0, pooled: bool = False,
              min_examples: int = 16) -> List[List[Example]]:
    """Distribute examples over training nodes and set every example's ``node`` (in place).

    * ``pooled``: one node holding everything (the centralized arm).
    * ``mode="seat"``: node j = the j-th list of ``per_seat``, unchanged.
    * ``mode="anchor"``: all examples pooled and split over ``n_partitions`` nodes (default
      ``len(per_seat)``) by :func:`anchor_node`, so all examples of a query land on one node;
      a node with fewer than ``min_examples`` examples is an error.
    """
    check_mode(mode, PARTITION_MODES, "partition mode")
    if not is_int(n_partitions) or n_partitions < 0:
        raise FitSetError(f"n_partitions must be an integer >= 0 (0 = one per seat), got "
                          f"{n_partitions!r}")
    if pooled and mode == "anchor":
        raise FitSetError("pooled and partition anchor exclude each other: the centralized "
                          "arm uses one node; drop one of the two")
    if mode == "seat" and n_partitions not in (0, len(per_seat)):
        raise FitSetError(f"n_partitions={n_partitions} applies to partition anchor only; "
                          f"set partition anchor or n_partitions 0")
    if pooled:
        merged = [ex for fs in per_seat for ex in fs]
        for ex in merged:
            ex.node = 0
        return [merged]
    if mode == "seat":
        out = []
        for j, fs in enumerate(per_seat):
            fs = list(fs)
            for ex in fs:
                ex.node = j
            out.append(fs)
        return out
    n = n_partitions or len(per_seat)
    if n < 1:
        raise FitSetError("partition anchor needs at least one node: set n_partitions >= 1")
    parts: List[List[Example]] = [[] for _ in range(n)]
    for fs in per_seat:
        for ex in fs:
            j = anchor_node(ex.anchor, n)
            ex.node = j
            parts[j].append(ex)
    thin = [i for i, f in enumerate(parts) if len(f) < min_examples]
    if thin:
        raise FitSetError(f"partition anchor: nodes {thin} hold fewer than {min_examples} "
                          f"examples (sizes {[len(f) for f in parts]}): use fewer partitions "
                          f"(n_partitions) or more anchors")
    return parts
