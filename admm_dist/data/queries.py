"""Which rows of a task train and which evaluate (docs/design.md section 4).

The task pool is shuffled once by the run's seed. Training queries come from its end (or
from ``anchor_offset``), evaluation from its front; evaluation refuses rows whose anchor
key a training report lists, so a leak is an error and not a silently inflated score.
Re-collection (``recollect_every``) takes the next fresh slice, moving towards the front.
"""
from __future__ import annotations

import random
from typing import List, Optional, Sequence

from admm_dist import tasks
from admm_dist.core.constants import MAX_OPS
from admm_dist.core.errors import UserError
from admm_dist.core.text import is_int


OPS_TASKS = ("chain_arith", "word_arith")   # the tasks whose problems take n_ops operations


def check_n_ops(task: str, n_ops: Optional[int]) -> None:
    """Refuse an ``n_ops`` the task cannot take, naming the fix (None: the task's own)."""
    if n_ops is None:
        return
    if not is_int(n_ops) or not 1 <= n_ops <= MAX_OPS:
        raise UserError(f"n_ops={n_ops!r}: use an integer from 1 to {MAX_OPS} (operations per problem)")
    if task not in OPS_TASKS:
        raise UserError(f"n_ops={n_ops} is for {' and '.join(OPS_TASKS)}, not task {task}: drop n_ops")


def pool(task: str, *, seed: int, split: Optional[str] = None, path: Optional[str] = None,
         n: Optional[int] = None, n_ops: Optional[int] = None) -> List[dict]:
    """The task's rows in the seed's order. ``split`` None is the task's evaluation split;
    ``n_ops`` the operations per problem of chain_arith and word_arith (None: theirs)."""
    check_n_ops(task, n_ops)
    kw = {"path": path} if path else {}
    if n is not None:
        kw["n"] = n
    if n_ops is not None:
        kw["n_ops"] = n_ops
    items = list(tasks.load(task, split=split or "eval", **kw))
    if not items:
        raise UserError(f"task {task} has no rows in split {split or 'eval'}"
                        + (f" of {path}" if path else "") + ": check --task_path / --anchor_split")
    random.Random(seed).shuffle(items)
    return items


def training_slice(items: Sequence[dict], count: int, *, offset: Optional[int] = None,
                   collection: int = 0, first: Optional[int] = None) -> List[dict]:
    """The rows of the ``collection``-th collection (0 = the first): ``first`` rows for the first
    (default ``count``), ``count`` for each re-collection, from the end of the pool or from row
    ``offset`` on; each re-collection takes the next fresh slice."""
    first = count if first is None else first
    if min(count, first) < 1:
        raise UserError(f"anchors={min(count, first)}: collect on at least one query")
    n = len(items)
    size = first if collection == 0 else count
    used = 0 if collection == 0 else first + (collection - 1) * count   # rows of the earlier slices
    if offset is not None:
        lo = offset + used
        if offset < 0 or lo + size > n:
            raise UserError(f"anchor_offset {offset} + {used + size} queries ({collection + 1} collections) "
                            f"exceeds the pool of {n} rows: lower --anchors, --recollect_anchors, "
                            f"--anchor_offset or --recollect_every")
        return list(items[lo:lo + size])
    hi = n - used
    if hi - size < 1:   # keep at least one row at the front for evaluation
        raise UserError(f"{used + size} training queries ({collection + 1} collections) do not fit in the "
                        f"pool of {n} rows: lower --anchors, --recollect_anchors (or --anchor_pool) or "
                        "--recollect_every")
    return list(items[hi - size:hi])


def evaluation_rows(items: Sequence[dict], n: Optional[int] = None, *, offset: int = 0) -> List[dict]:
    """Rows from the front of the pool."""
    end = len(items) if n is None else offset + n
    if offset < 0 or end > len(items):
        raise UserError(f"rows [{offset}, {end}) exceed the pool of {len(items)}: lower --n or --offset")
    return list(items[offset:end])


def refuse_leaks(rows: Sequence[dict], train_keys: Sequence[str], *,
                 report: str = "the training report") -> None:
    """Raise if any row was a training query (by anchor key)."""
    used = set(train_keys)
    leaked = [r["anchor"] for r in rows if r["anchor"] in used]
    if leaked:
        raise UserError(f"{len(leaked)} of {len(rows)} evaluation rows were training queries in {report} "
                        f"(e.g. anchor {leaked[0]}): evaluate other rows (--offset, --n) or train with a "
                        f"different --anchor_offset")
