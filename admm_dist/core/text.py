"""Text conventions shared by every layer: the reasoning block, choice letters, integers, and
docstrings turned into plain text for a command's ``--help`` (:func:`plain`), and memory sizes
such as ``80GiB`` read (:func:`parse_size`) and shown (:func:`size_unit`, :func:`size_text`).

One definition each. The *visible* part of a message is the text after its last ``</think>``
(the rule of Qwen3's chat template, which drops everything up to the last closing tag when a
message enters the history); a message without one is all visible.
"""
from __future__ import annotations

import re
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
LETTERS = "ABCDEFGHIJ"      # the option letters of a multiple-choice item, in order
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(GiB|GB|G|MiB|MB|M)?\s*$", re.IGNORECASE)
_UNITS = {"gib": 1 << 30, "g": 1 << 30, "gb": 10 ** 9, "mib": 1 << 20, "m": 1 << 20, "mb": 10 ** 6, "": 1}


def visible(text: str) -> str:
    """The text after the last ``</think>`` (what the agent says, not what it thought)."""
    return text.rsplit(THINK_CLOSE, 1)[-1]


def is_int(v: Any) -> bool:
    """An ``int`` that is not a ``bool`` (JSON and YAML integers, not ``true``)."""
    return isinstance(v, int) and not isinstance(v, bool)


_ROLE = re.compile(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")    # :mod:`x`, :class:`~a.b.C`, :ref:`t <x>`
_LITERAL = re.compile(r"``(.+?)``", re.S)


def plain(doc: str) -> str:
    """A docstring as plain text for ``--help``: reST roles become their target's name (the last
    part after a ``~``), double-backtick literals their text."""
    def role(m: "re.Match") -> str:
        name = m.group(1).strip()
        return name.rsplit(".", 1)[-1] if m.group(0).split("`", 1)[1].startswith("~") else name
    return _LITERAL.sub(r"\1", _ROLE.sub(role, doc or ""))


def parse_size(text: str) -> int:
    """``80GiB``, ``24G`` (GiB), ``40GB``, ``512MiB`` or a number of bytes -> bytes; ValueError
    (naming the forms) for anything else."""
    m = _SIZE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r}: give a size such as 80GiB, 40GB or 24G")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


_BINARY = ("B", "KiB", "MiB", "GiB", "TiB")


def size_unit(n: float, smallest: str = "B") -> "tuple[str, int]":
    """The unit that shows ``n`` bytes (or a column whose largest is ``n``) as a number below 1024,
    and its size in bytes: B to TiB, never below ``smallest``."""
    power = _BINARY.index(smallest)
    while n >= 1024 ** (power + 1) and power < len(_BINARY) - 1:
        power += 1
    return _BINARY[power], 1024 ** power


def size_text(n: int) -> str:
    """``n`` bytes as ``1.50 GiB``, or in MiB below 1 GiB (a device's memory, a rank's peak)."""
    unit, scale = size_unit(n, smallest="MiB")
    return f"{n / scale:.2f} {unit}"
