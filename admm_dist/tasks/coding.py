"""Code-writing tasks scored by running tests in the sandbox: ``mbppplus``, ``humanevalplus``.

Items carry ``entry_point`` (the function under test), ``tests`` (the data set's test code),
``gold`` (a complete test program: run after the answer's code, it exits 0 when the code is
right) and ``preamble`` (imports run before the answer's code).

- MBPP+ rows: ``prompt`` (the task in words), ``code`` (a reference solution), ``test`` (the
  EvalPlus test program; plain MBPP's ``test_list`` asserts stand in when it is absent),
  ``test_list``, ``test_imports``, ``entry_point`` (else the first tested function that
  ``code`` defines).
- HumanEval+ rows: ``prompt`` (signature and docstring), ``test`` (defines ``check``),
  ``entry_point``; ``code_prompt`` keeps the prompt so that an answer giving only the body can
  be run after it.
"""
from __future__ import annotations

import re
from typing import List

from admm_dist.core.errors import UserError
from admm_dist.tasks.common import Hub, build, col, make_item, structured
from admm_dist.tasks.registry import TaskSpec, register

MBPPPLUS = Hub("evalplus/mbppplus", splits=(("eval", "test"), ("train", "test")))
HUMANEVALPLUS = Hub("evalplus/humanevalplus", splits=(("eval", "test"), ("train", "test")))
_IMPORT = re.compile(r"^(?:import|from)\s+\S+.*$", re.M)


def _strings(value, where: str, name: str) -> List[str]:
    value = structured(value, where, name) if value not in (None, "") else []
    return [str(v) for v in value]


def _mbpp_entry(where: str, row: dict, asserts: List[str]) -> str:
    entry = row.get("entry_point")
    if entry:
        return str(entry)
    defined = re.findall(r"^def\s+(\w+)\s*\(", str(row.get("code", "")), re.M)
    called = re.findall(r"(\w+)\s*\(", "\n".join(asserts) + "\n" + str(row.get("test", "")))
    for name in called:
        if name in defined:
            return name
    if defined:
        return defined[-1]
    raise UserError(f"{where}: missing column 'entry_point' (and no 'code' to find it in)")


def _mbpp_item(where: str, row: dict) -> dict:
    prompt = str(col(row, ("prompt", "text"), where)).strip()
    asserts = _strings(row.get("test_list"), where, "test_list")
    imports = "\n".join(_strings(row.get("test_imports"), where, "test_imports"))
    tests = col(row, "test", where, default="") or "\n".join(asserts)
    if not tests:
        raise UserError(f"{where}: missing column 'test' (or 'test_list')")
    entry = _mbpp_entry(where, row, asserts)
    shown = f"Your code should pass this test:\n{asserts[0]}" if asserts else f"Name the function `{entry}`."
    gold = "\n".join(p for p in (imports, tests) if p)
    return make_item("mbppplus", "code", f"{prompt}\n\n{shown}", gold, stem=prompt,
                     entry_point=entry, tests=tests, preamble=imports, task_id=row.get("task_id"))


def _humaneval_item(where: str, row: dict) -> dict:
    prompt, tests = str(col(row, "prompt", where)), str(col(row, "test", where))
    entry = str(col(row, "entry_point", where))
    question = f"Complete the following Python function.\n\n```python\n{prompt.rstrip()}\n```"
    return make_item("humanevalplus", "code", question, f"{tests}\n\ncheck({entry})\n", stem=prompt,
                     entry_point=entry, tests=tests, preamble="\n".join(_IMPORT.findall(prompt)),
                     code_prompt=prompt, task_id=row.get("task_id"))


def load_mbppplus(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """MBPP+ (``evalplus/mbppplus``, 378 problems, one split)."""
    return build("mbppplus", MBPPPLUS, _mbpp_item, split, n, path, kw)


def load_humanevalplus(split="eval", n=None, seed=0, path=None, **kw) -> List[dict]:
    """HumanEval+ (``evalplus/humanevalplus``, 164 problems, one split)."""
    return build("humanevalplus", HUMANEVALPLUS, _humaneval_item, split, n, path, kw)


register(TaskSpec("mbppplus", "code", load_mbppplus, "basic Python functions, EvalPlus tests"))
register(TaskSpec("humanevalplus", "code", load_humanevalplus, "HumanEval functions, EvalPlus tests"))
