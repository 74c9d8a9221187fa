"""The task registry: a :class:`TaskSpec` per task name, :func:`get` with a clear error,
:func:`load` for the items and :func:`score` for a final answer. Task modules register here.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

from admm_dist.core.errors import UserError

ANSWER_TYPES = ("number", "choice", "code", "safety")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    answer_type: str
    loader: Callable[..., List[dict]]
    description: str = ""
    # (text, item) -> (prediction, correct?); None: score by answer type (scoring.score_item)
    scorer: Optional[Callable[[str, dict], Tuple[Optional[str], bool]]] = None
    words: str = "default"          # the prompt wording the chain uses (mas.prompts.WORDINGS)

    def __post_init__(self) -> None:
        if self.answer_type not in ANSWER_TYPES:
            raise UserError(f"task {self.name}: answer_type {self.answer_type!r} is not one of "
                            f"{', '.join(ANSWER_TYPES)}")


REGISTRY: Dict[str, TaskSpec] = {}


def register(spec: TaskSpec) -> TaskSpec:
    if spec.name in REGISTRY:
        raise UserError(f"task {spec.name!r} is registered twice")
    REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> TaskSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown task {name!r}: choose one of {', '.join(sorted(REGISTRY))} with --task "
                        "(or train on a fit set you built with --fitset_cache FILE)") from None


def load(name: str, **kw) -> List[dict]:
    return get(name).loader(**kw)


def score(name: str, text: str, item: dict) -> Tuple[Optional[str], bool]:
    """(prediction, correct?) of a final answer ``text`` to ``item`` of task ``name``."""
    spec = get(name)
    if spec.scorer is not None:
        return spec.scorer(text, item)
    from admm_dist.tasks.scoring import score_item  # scoring imports the sandbox: load it late
    return score_item(text, item)
