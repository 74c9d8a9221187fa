"""``chain_arith``: multi-step arithmetic where every seat of the chain does one step.

A question gives a start value and one operation per seat that works (``n_ops``, three for
a 4-seat chain): seat 1 applies the first operation to the start value, each later seat
applies the next operation to the running result, and the last seat states the final
answer. No operation is an identity (no +0, -0, *1, nor *k on 0) and every operation is
injective, so a seat that merely copies the previous result leaves the chain with a wrong
final answer.

Items are generated from a seed; each question's split (``train`` or ``eval``) is fixed by
a hash of its text, so the two splits never share a row whatever their sizes.
"""
from __future__ import annotations

import hashlib
import random
from typing import Dict, List

from . import TaskSpec, register

OPS = ("+", "-", "*")
EVAL_SHARE = 0.2


def _apply(value: int, op: str, arg: int) -> int:
    return value + arg if op == "+" else value - arg if op == "-" else value * arg


def make_item(rng: random.Random, n_ops: int = 3) -> Dict[str, object]:
    start = rng.randint(2, 30)
    ops, steps, value = [], [], start
    for _ in range(n_ops):
        op = rng.choice(OPS)
        arg = rng.randint(2, 9) if op == "*" else rng.randint(1, 30)
        if op == "*" and (abs(value) > 200 or value == 0):  # short numbers; 0*k would be a no-op
            op, arg = "+", rng.randint(1, 30)
        value = _apply(value, op, arg)
        ops.append(f"{op}{arg}")
        steps.append(value)
    question = f"Start with {start}. Apply in order: {', '.join(ops)}."
    key = hashlib.sha1(question.encode()).hexdigest()[:16]
    return {"question": question, "gold": str(value), "answer_type": "number", "anchor": key,
            "start": start, "ops": ops, "steps": steps}


def split_of(item: Dict[str, object]) -> str:
    h = int(hashlib.sha1(str(item["question"]).encode()).hexdigest(), 16)
    return "eval" if (h % 1000) < EVAL_SHARE * 1000 else "train"


def load_chain_arith(split: str = "eval", n: int = 400, seed: int = 0, n_ops: int = 3) -> List[dict]:
    """``n`` distinct items of ``split`` ("train" or "eval"), deterministic in ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: use train or eval")
    if n < 1 or n_ops < 1:
        raise ValueError("n and n_ops must be >= 1")
    rng = random.Random(f"chain_arith|{seed}|{n_ops}")
    seen, out = set(), []
    for _ in range(200 * n):
        item = make_item(rng, n_ops)
        if item["question"] in seen:
            continue
        seen.add(item["question"])
        if split_of(item) == split:
            out.append(item)
            if len(out) == n:
                return out
    raise ValueError(f"could not draw {n} distinct {split} items with n_ops={n_ops}: ask for fewer")


register(TaskSpec("chain_arith", "number", load_chain_arith,
                  "synthetic multi-step arithmetic, one operation per seat"))
