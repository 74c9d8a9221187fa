"""Scoring by answer type, on the visible answer (the text after the last ``</think>``).

- number: the last ``\\boxed{...}`` number, else the last number, equals the gold number.
- choice: the chosen letter ("Answer: B", "the answer is (B)", ``\\boxed{B}``, else the last
  standalone capital A-J) equals the gold letter.
- code: the last ```python block (else the whole answer) runs with the tests in the sandbox
  (:mod:`admm_dist.tasks.sandbox`); it is right when the program runs past the tests in time. The
  first code answer prints one note line (stderr) saying which isolation is in force; where
  none is allowed it raises :class:`~admm_dist.tasks.sandbox.SandboxUnavailable` instead of scoring.
- safety: judged by a judge model, not here.

:func:`score` needs only the gold string; :func:`score_item` takes a task item and also
passes what code needs besides it (preamble, entry point, time limit).
"""
from __future__ import annotations

import re
import secrets
import sys
from typing import Optional, Tuple

from admm_dist.tasks import sandbox
from admm_dist.tasks.sandbox import run_python

LETTERS = "ABCDEFGHIJ"
_NUM = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER = re.compile(r"(?i:answer|correct\s+(?:option|choice))\s*(?:(?i:is|:|=)\s*)?"
                     r"(?:(?i:option|choice)\s*)?[\s*_(\[{:]*([A-J])(?![A-Za-z0-9])")
_LONE = re.compile(r"(?<![A-Za-z0-9'])([A-J])(?![A-Za-z0-9'])")
_WORD_AFTER = re.compile(r"\s+([a-z]+)")
_VERBS = {"is", "was", "seems", "appears", "would", "should", "must", "matches", "fits", "and", "or"}
_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
_sandbox_noted = False


def visible(text: str) -> str:
    """The text after the last ``</think>`` (what the agent says, not what it thought)."""
    return text.rsplit("</think>", 1)[-1]


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0 or text[start + 6:i].strip():
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def normalize_number(x: str) -> str:
    """``-007.50`` -> ``-7.5``; ``-0`` -> ``0``."""
    neg, x = x.startswith("-"), x.lstrip("-")
    whole, _, frac = x.partition(".")
    frac = frac.rstrip("0")
    x = (whole.lstrip("0") or "0") + (f".{frac}" if frac else "")
    return f"-{x}" if neg and x != "0" else x


def extract_number(text: str) -> Optional[str]:
    text = visible(text)
    boxed = last_boxed(text)
    for part in ([boxed] if boxed is not None else []) + [text]:
        found = _NUM.findall(part.replace(",", ""))
        if found:
            return normalize_number(found[-1])
    return None


def _article_or_pronoun(text: str, m: re.Match) -> bool:
    """"A good ..." / "I think ..." are words, not options; "A is right" is an option."""
    if m.group(1) not in "AI":
        return False
    if text[m.end():m.end() + 1] == "'":
        return True
    w = _WORD_AFTER.match(text, m.end())
    return bool(w) and w.group(1) not in _VERBS


def extract_choice(text: str, letters: str = LETTERS) -> Optional[str]:
    """The chosen letter among ``letters``: boxed, then "answer ...", then the last lone capital."""
    text = visible(text)
    boxed = last_boxed(text)
    if boxed is not None:
        inner = re.sub(r"\\text(?:bf)?\s*\{([^{}]*)\}", r"\1", boxed).strip(" ()*.:")
        m = re.match(r"([A-J])(?![A-Za-z0-9])", inner)
        if m and m.group(1) in letters:
            return m.group(1)
    said = [m.group(1) for m in _ANSWER.finditer(text) if m.group(1) in letters]
    if said:
        return said[-1]
    lone = [m.group(1) for m in _LONE.finditer(text)
            if m.group(1) in letters and not _article_or_pronoun(text, m)]
    return lone[-1] if lone else None


def extract_code(text: str) -> str:
    """The last ```python (or ```py) block, else the last ``` block, else the whole answer."""
    text = visible(text)
    blocks = _FENCE.findall(text)
    tagged = [body for tag, body in blocks if tag]
    pick = tagged or [body for _, body in blocks]
    return (pick[-1] if pick else text).strip("\n") + "\n"


def run_code(code: str, tests: str, *, preamble: str = "", timeout_s: float = 10.0,
             memory_mb: int = 512) -> bool:
    """Does ``preamble + code + tests`` run to the end in the sandbox?

    The end is a fresh token printed after the tests, so code that exits early with status
    0 (``sys.exit(0)``, ``os._exit(0)``) before the tests ran does not pass.
    """
    global _sandbox_noted
    if not _sandbox_noted:
        sandbox.isolation()  # refuses here (SandboxUnavailable) where no isolation is allowed
        print(f"note: {sandbox.describe()}", file=sys.stderr)
        _sandbox_noted = True
    token = f"admm-tests-passed-{secrets.token_hex(8)}"
    program = "\n".join(p for p in (preamble, code, tests, f"print({token!r}, flush=True)") if p)
    result = run_python(program, timeout_s=timeout_s, memory_mb=memory_mb)
    return result.ok and result.stdout_tail.rstrip().endswith(token)


def score(text: str, gold: str, answer_type: str) -> Tuple[Optional[str], bool]:
    """(extracted prediction, correct?)"""
    if answer_type == "number":
        pred = extract_number(text)
        return pred, pred is not None and pred == extract_number(str(gold))
    if answer_type == "choice":
        pred = extract_choice(text)
        return pred, pred is not None and pred == str(gold).strip().upper()
    if answer_type == "code":
        pred = extract_code(text)
        return pred, run_code(pred, str(gold))
    if answer_type == "safety":
        raise ValueError("safety answers are scored by a judge model, not here: use the judge "
                         "reward for safety tasks")
    raise ValueError(f"answer_type {answer_type!r} has no scorer: use number, choice, code or safety")


def score_item(text: str, item: dict) -> Tuple[Optional[str], bool]:
    """:func:`score` for a task item; choice uses the item's letters, code its preamble/limits.

    A code answer that never defines ``entry_point`` is taken as the body that continues the
    item's ``code_prompt`` (HumanEval style) and run after it.
    """
    kind = item["answer_type"]
    if kind == "choice" and item.get("choices"):
        pred = extract_choice(text, LETTERS[:len(item["choices"])])
        return pred, pred is not None and pred == str(item["gold"]).strip().upper()
    if kind == "code":
        pred = extract_code(text)
        entry = item.get("entry_point")
        if entry and item.get("code_prompt") and not re.search(rf"def\s+{re.escape(entry)}\s*\(", pred):
            pred = item["code_prompt"] + pred  # a bare body continuing the given signature
        return pred, run_code(pred, item["gold"], preamble=item.get("preamble", ""),
                              timeout_s=float(item.get("timeout_s", 10.0)),
                              memory_mb=int(item.get("memory_mb", 512)))
    return score(text, item["gold"], kind)
