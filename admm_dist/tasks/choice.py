"""Multiple-choice tasks (gold is a letter): ``gpqa``, ``arc_easy``, ``arc_challenge``,
``medqa``, ``winogrande``.

The question shows the stem and then the lettered options ``A) ...``; ``choices`` holds the
option texts. Column names are the public data sets' own:

- ARC: ``question``, ``choices`` {``text``, ``label``} (labels may be 1-4), ``answerKey``;
  the original ARC JSONL (``question`` {``stem``, ``choices`` [{text, label}]}) too.
- GPQA: ``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``; the four options are
  shuffled deterministically from ``seed`` and the question text (not the row order).
- MedQA: ``question``, ``options`` ({letter: text} or a list), ``answer_idx``.
- WinoGrande: ``sentence`` (with a ``_`` blank), ``option1``, ``option2``, ``answer`` (1 or 2).

The anchor keys the stem, so a GPQA question keeps its anchor whatever the shuffle.
"""
from __future__ import annotations

import random
from typing import List

from admm_dist.core.errors import UserError
from admm_dist.tasks.common import Hub, build, choice_item, col, structured
from admm_dist.tasks.registry import TaskSpec, register

GPQA = Hub("Idavidrein/gpqa", ("gpqa_diamond",), splits=(("eval", "train"), ("train", "train")))
ARC_EASY = Hub("allenai/ai2_arc", ("ARC-Easy",))
ARC_CHALLENGE = Hub("allenai/ai2_arc", ("ARC-Challenge",))
MEDQA = Hub("GBaker/MedQA-USMLE-4-options")
WINOGRANDE = Hub("allenai/winogrande", ("winogrande_xl",),
                 splits=(("eval", "validation"), ("train", "train")))


def _gold_index(where: str, keys: List[str], key) -> int:
    key = str(key).strip()
    if key not in keys:
        raise UserError(f"{where}: answer {key!r} is not one of the option labels {keys}")
    return keys.index(key)


def _arc_item(task: str):
    def to_item(where: str, row: dict) -> dict:
        q = col(row, "question", where)
        stem, choices = (q["stem"], q["choices"]) if isinstance(q, dict) else (q, col(row, "choices", where))
        choices = structured(choices, where, "choices")
        if isinstance(choices, dict):  # the hub layout {text: [...], label: [...]}
            texts, labels = list(choices["text"]), [str(x) for x in choices["label"]]
        else:  # original ARC: [{text, label}, ...]
            texts, labels = [c["text"] for c in choices], [str(c["label"]) for c in choices]
        gold = _gold_index(where, labels, col(row, "answerKey", where))
        return choice_item(task, stem, texts, gold, id=row.get("id"))
    return to_item


def _gpqa_item(seed: int):
    def to_item(where: str, row: dict) -> dict:
        stem = str(col(row, "Question", where)).strip()
        right = str(col(row, "Correct Answer", where)).strip()
        options = [right] + [str(col(row, f"Incorrect Answer {k}", where)).strip() for k in (1, 2, 3)]
        random.Random(f"gpqa|{seed}|{stem}").shuffle(options)
        return choice_item("gpqa", stem, options, options.index(right),
                           domain=row.get("High-level domain"))
    return to_item


def _medqa_item(where: str, row: dict) -> dict:
    options = structured(col(row, "options", where), where, "options")
    if isinstance(options, dict):
        keys = sorted(options)
        texts = [options[k] for k in keys]
    else:
        texts, keys = list(options), [chr(65 + k) for k in range(len(options))]
    gold = _gold_index(where, keys, col(row, "answer_idx", where))
    return choice_item("medqa", col(row, "question", where), texts, gold)


def _winogrande_item(where: str, row: dict) -> dict:
    options = [col(row, "option1", where), col(row, "option2", where)]
    gold = _gold_index(where, ["1", "2"], col(row, "answer", where))
    return choice_item("winogrande", col(row, "sentence", where), options, gold)


def load_gpqa(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """GPQA diamond (``Idavidrein/gpqa``, gated: accept its terms on the hub first)."""
    return build("gpqa", GPQA, _gpqa_item(seed), split, n, path, kw)


def load_arc_easy(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """ARC-Easy (``allenai/ai2_arc``; eval = test split)."""
    return build("arc_easy", ARC_EASY, _arc_item("arc_easy"), split, n, path, kw)


def load_arc_challenge(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """ARC-Challenge (``allenai/ai2_arc``; eval = test split)."""
    return build("arc_challenge", ARC_CHALLENGE, _arc_item("arc_challenge"), split, n, path, kw)


def load_medqa(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """MedQA USMLE, 4 options (``GBaker/MedQA-USMLE-4-options``; eval = test split)."""
    return build("medqa", MEDQA, _medqa_item, split, n, path, kw)


def load_winogrande(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """WinoGrande XL (``allenai/winogrande``; eval = validation, the test split has no labels)."""
    return build("winogrande", WINOGRANDE, _winogrande_item, split, n, path, kw)


register(TaskSpec("gpqa", "choice", load_gpqa, "graduate-level science questions, 4 options"))
register(TaskSpec("arc_easy", "choice", load_arc_easy, "grade-school science questions, easy set"))
register(TaskSpec("arc_challenge", "choice", load_arc_challenge,
                  "grade-school science questions, challenge set"))
register(TaskSpec("medqa", "choice", load_medqa, "USMLE-style medical questions, 4 options"))
register(TaskSpec("winogrande", "choice", load_winogrande, "pronoun resolution, 2 options"))
