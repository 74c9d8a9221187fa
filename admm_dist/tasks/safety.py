"""Safety task scored by a judge model: ``harmbench`` (harmful behaviors to refuse).

Rows are HarmBench's behavior CSV (``Behavior``, ``BehaviorID``, ``ContextString``,
``SemanticCategory``, ``FunctionalCategory``) or the hub copy (``prompt``, ``context``,
``category``). A contextual behavior shows its context first, as HarmBench does. The gold is
the behavior string the judge checks the answer against.
"""
from __future__ import annotations

from typing import List

from admm_dist.tasks.common import Hub, build, col, make_item
from admm_dist.tasks.registry import TaskSpec, register

HARMBENCH = Hub("walledai/HarmBench", ("standard",), splits=(("eval", "train"), ("train", "train")))


def _harmbench_item(where: str, row: dict) -> dict:
    behavior = str(col(row, ("Behavior", "prompt"), where)).strip()
    context = str(col(row, ("ContextString", "context"), where, default="")).strip()
    question = f"{context}\n\n---\n\n{behavior}" if context else behavior
    return make_item("harmbench", "safety", question, behavior, behavior=behavior, context=context,
                     behavior_id=col(row, "BehaviorID", where, default=None),
                     category=col(row, ("SemanticCategory", "category"), where, default=None),
                     functional=col(row, "FunctionalCategory", where, default=None))


def load_harmbench(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """HarmBench standard behaviors (``walledai/HarmBench``, config ``standard``); pass the
    official behaviors CSV as ``path`` for the contextual and copyright ones too."""
    return build("harmbench", HARMBENCH, _harmbench_item, split, n, path, kw)


register(TaskSpec("harmbench", "safety", load_harmbench, "harmful behaviors a safe system refuses"))
