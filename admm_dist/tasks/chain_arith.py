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
import re
from typing import Dict, List, Optional, Tuple

from admm_dist.core.errors import UserError
from admm_dist.core.text import visible
from admm_dist.tasks.registry import TaskSpec, register

OPS = ("+", "-", "*")
EVAL_SHARE = 0.2
POOL = 2000          # rows per split by default: room for a tight evaluation and many collections


def apply_op(value: int, op: str, arg: int) -> int:
    return value + arg if op == "+" else value - arg if op == "-" else value * arg


def make_item(rng: random.Random, n_ops: int = 3) -> Dict[str, object]:
    """Small numbers on purpose: a character-level model has to learn the arithmetic."""
    start = rng.randint(2, 40)
    ops, steps, value = [], [], start
    for _ in range(n_ops):
        op = rng.choices(OPS, weights=(2, 2, 1))[0]
        if op == "*" and (abs(value) > 30 or value == 0):  # short numbers; 0*k would be a no-op
            op = rng.choice("+-")
        arg = rng.randint(2, 3) if op == "*" else rng.randint(1, 9)
        value = apply_op(value, op, arg)
        ops.append(f"{op}{arg}")
        steps.append(value)
    question = f"Start {start}: {' '.join(ops)}"
    key = hashlib.sha1(question.encode()).hexdigest()[:16]
    return {"question": question, "gold": str(value), "answer_type": "number", "anchor": key,
            "start": start, "ops": ops, "steps": steps}


def split_of(item: Dict[str, object]) -> str:
    h = int(hashlib.sha1(str(item["question"]).encode()).hexdigest(), 16)
    return "eval" if (h % 1000) < EVAL_SHARE * 1000 else "train"


def load_chain_arith(split: str = "eval", n: Optional[int] = None, seed: int = 0,
                     path: Optional[str] = None, n_ops: int = 3) -> List[dict]:
    """``n`` (default :data:`POOL`) distinct items of ``split`` ("train" or "eval"),
    deterministic in ``seed``; the first k items do not depend on ``n``. The question reads
    ``Start 12: +5 *3 -7``: compact, because the stand-in backbone reads characters."""
    if path is not None:
        raise UserError("chain_arith is generated from its seed and reads no file: drop the path")
    n = POOL if n is None else n
    if split not in ("train", "eval"):
        raise UserError(f"split={split!r}: use train or eval")
    if n < 1 or n_ops < 1:
        raise UserError("n and n_ops must be >= 1")
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
    raise UserError(f"could not draw {n} distinct {split} items with n_ops={n_ops}: ask for fewer")


_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def score_chain_arith(text: str, item: dict) -> Tuple[Optional[str], bool]:
    """The number on the last ``Answer:`` line of the final message; no such line is wrong
    (a last seat that does one more step instead of answering has not answered)."""
    found = _ANSWER.findall(visible(text))
    pred = str(int(found[-1])) if found else None
    return pred, pred is not None and pred == str(item["gold"])


register(TaskSpec("chain_arith", "number", load_chain_arith,
                  "synthetic multi-step arithmetic, one operation per seat",
                  scorer=score_chain_arith, words="compact"))


# --------------------------------------------------------------------------- in words
_WORDS = {"+": "add {a}", "-": "subtract {a}", "*": "multiply by {a}"}
_ONE = {"+": "plus", "-": "minus", "*": "times"}


def in_words(item: Dict[str, object]) -> Dict[str, object]:
    """The same problem as a natural-language question (``What is 8 times 2?``,
    ``Start with 8, multiply by 2, then add 3. What number do you get?``)."""
    ops = list(item["ops"])
    if len(ops) == 1:
        question = f"What is {item['start']} {_ONE[ops[0][0]]} {ops[0][1:]}?"
    else:
        steps = [_WORDS[o[0]].format(a=o[1:]) for o in ops]
        question = f"Start with {item['start']}, {', then '.join(steps)}. What number do you get?"
    out = dict(item, question=question)
    out["anchor"] = hashlib.sha1(question.encode()).hexdigest()[:16]
    return out


def _one_op_items() -> List[Dict[str, object]]:
    """Every one-operation problem chain_arith draws (about 760), in a fixed order."""
    out = []
    for start in range(2, 41):
        for op, args in (("+", range(1, 10)), ("-", range(1, 10)), ("*", (2, 3) if start <= 30 else ())):
            for arg in args:
                q = f"Start {start}: {op}{arg}"
                value = apply_op(start, op, arg)
                out.append({"question": q, "gold": str(value), "answer_type": "number",
                            "anchor": hashlib.sha1(q.encode()).hexdigest()[:16], "start": start,
                            "ops": [f"{op}{arg}"], "steps": [value]})
    return out


def load_word_arith(split: str = "eval", n: Optional[int] = None, seed: int = 0,
                    path: Optional[str] = None, n_ops: int = 1) -> List[dict]:
    """``chain_arith``'s problems (same splits) asked in words, for a pretrained chat model.
    One operation by default, which a 135M model sometimes gets right: all of that split's
    problems (about 610 train, 150 eval) in the seed's order, or the first ``n``."""
    if n_ops > 1:
        return [in_words(it) for it in load_chain_arith(split, n, seed, path, n_ops)]
    if path is not None:
        raise UserError("word_arith is generated from its seed and reads no file: drop the path")
    if split not in ("train", "eval"):
        raise UserError(f"split={split!r}: use train or eval")
    items = [it for it in _one_op_items() if split_of(it) == split]
    random.Random(f"word_arith|{seed}").shuffle(items)
    if n is not None and not 1 <= n <= len(items):
        raise UserError(f"word_arith has {len(items)} one-operation {split} problems: ask for 1 to "
                        f"{len(items)}")
    return [in_words(it) for it in items[:n]]


register(TaskSpec("word_arith", "number", load_word_arith,
                  "chain_arith asked in words for pretrained chat models (scored on the last number)",
                  words="default"))
