"""Scoring by answer type. Numbers: the last number in the visible answer equals the gold."""
from __future__ import annotations

import re
from typing import Optional, Tuple

_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def visible(text: str) -> str:
    """The text after the last ``</think>`` (what the agent says, not what it thought)."""
    return text.rsplit("</think>", 1)[-1]


def extract_number(text: str) -> Optional[str]:
    found = _NUM.findall(visible(text).replace(",", ""))
    if not found:
        return None
    x = found[-1]
    if "." in x:
        x = x.rstrip("0").rstrip(".")
    return "0" if x in ("-0", "") else x


def score(text: str, gold: str, answer_type: str) -> Tuple[Optional[str], bool]:
    """(extracted prediction, correct?)"""
    if answer_type == "number":
        pred = extract_number(text)
        return pred, pred is not None and pred == extract_number(str(gold))
    raise ValueError(f"answer_type {answer_type!r} has no scorer yet: number is supported")
