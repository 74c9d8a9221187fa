"""Math word problems with a number answer: ``gsm8k``, ``aime2024``, ``aime2025``.

GSM8K rows are ``question``/``answer`` with the worked solution ending ``#### 42``; AIME
rows are ``problem``/``answer`` (also ``Problem``/``Answer``, or ``question``). The gold is
the normalized number (commas dropped, ``033`` -> ``33``).
"""
from __future__ import annotations

import re
from typing import List

from admm_dist.core.errors import UserError
from admm_dist.tasks.common import Hub, build, col, make_item
from admm_dist.tasks.registry import TaskSpec, register
from admm_dist.tasks.scoring import extract_number

GSM8K = Hub("openai/gsm8k", ("main",))
AIME2024 = Hub("HuggingFaceH4/aime_2024", splits=(("eval", "train"), ("train", "train")))
AIME2025 = Hub("opencompass/AIME2025", ("AIME2025-I", "AIME2025-II"),
               splits=(("eval", "test"), ("train", "test")))
_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)


def _number(where: str, value) -> str:
    gold = extract_number(str(value))
    if gold is None:
        raise UserError(f"{where}: answer {str(value)[:40]!r} holds no number")
    return gold


def _gsm8k_item(where: str, row: dict) -> dict:
    question, solution = col(row, "question", where), str(col(row, "answer", where))
    final = _FINAL.search(solution)
    if not final:
        raise UserError(f"{where}: answer has no final '#### N' line (the GSM8K format)")
    return make_item("gsm8k", "number", question, _number(where, final.group(1)),
                     solution=solution[:final.start()].strip())


def _aime_item(task: str):
    def to_item(where: str, row: dict) -> dict:
        problem = col(row, ("problem", "Problem", "question"), where)
        return make_item(task, "number", problem,
                         _number(where, col(row, ("answer", "Answer"), where)))
    return to_item


def load_gsm8k(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """GSM8K (``openai/gsm8k``, config ``main``; eval = test split)."""
    return build("gsm8k", GSM8K, _gsm8k_item, split, n, path, kw)


def load_aime2024(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """AIME 2024 (``HuggingFaceH4/aime_2024``, 30 problems, one split)."""
    return build("aime2024", AIME2024, _aime_item("aime2024"), split, n, path, kw)


def load_aime2025(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """AIME 2025 I and II (``opencompass/AIME2025``, 30 problems)."""
    return build("aime2025", AIME2025, _aime_item("aime2025"), split, n, path, kw)


register(TaskSpec("gsm8k", "number", load_gsm8k, "grade-school math word problems"))
register(TaskSpec("aime2024", "number", load_aime2024, "AIME 2024 competition problems"))
register(TaskSpec("aime2025", "number", load_aime2025, "AIME 2025 competition problems"))
