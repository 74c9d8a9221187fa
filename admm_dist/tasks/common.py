"""Shared plumbing for the real tasks: read rows from a local file or the hub, build items.

A loader names its public data set (:class:`Hub`) and maps one row to an item with
:func:`make_item`. :func:`rows` gives the raw rows: from ``path`` (JSON list, JSONL or CSV)
when one is given, else through ``datasets.load_dataset`` (imported only then). Each row
comes with a ``where`` label (``"file.jsonl row 3"``) so that :func:`col` can raise a one-line
error naming the file, the row and the missing column. A local file is taken as the split
asked for; ``split`` ("eval", "train" or a hub split name) only picks the hub split.
"""
from __future__ import annotations

import ast
import csv
import dataclasses
import hashlib
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

from admm_dist.core.errors import UserError

LETTERS = "ABCDEFGHIJ"
Row = Tuple[str, dict]  # (where, row)


@dataclasses.dataclass(frozen=True)
class Hub:
    """A public data set: hub id, config names (rows are concatenated), split per our split."""
    repo: str
    configs: Tuple[Optional[str], ...] = (None,)
    splits: Tuple[Tuple[str, str], ...] = (("eval", "test"), ("train", "train"))

    def split(self, split: str) -> str:
        return dict(self.splits).get(split, split)


def anchor(task: str, text: str) -> str:
    """Stable key of one problem: sha1 of the task name and the problem text, 16 hex chars."""
    return hashlib.sha1(f"{task}\n{text}".encode()).hexdigest()[:16]


def make_item(task: str, answer_type: str, question: str, gold: str, stem: str = None, **extra) -> dict:
    """An item; ``stem`` (the problem text before any options, default ``question``) keys it."""
    item = {"question": question, "gold": str(gold), "answer_type": answer_type,
            "anchor": anchor(task, question if stem is None else stem)}
    item.update(extra)
    return item


def lettered(options: Sequence[str]) -> str:
    """``A) first\\nB) second ...``"""
    if not 2 <= len(options) <= len(LETTERS):
        raise UserError(f"{len(options)} options: a choice item needs 2 to {len(LETTERS)}")
    return "\n".join(f"{LETTERS[k]}) {str(o).strip()}" for k, o in enumerate(options))


def choice_item(task: str, stem: str, options: Sequence[str], gold_index: int, **extra) -> dict:
    """A choice item: the stem, then the lettered options; gold is the right letter."""
    question = f"{stem.strip()}\n\n{lettered(options)}"
    return make_item(task, "choice", question, LETTERS[gold_index], stem=stem.strip(),
                     choices=[str(o).strip() for o in options], **extra)


def col(row: dict, names, where: str, default=KeyError):
    """The first present, non-empty column of ``names`` (a name or a tuple of aliases)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        value = row.get(name)
        if value is not None and value != "":
            return value
    if default is not KeyError:
        return default
    wanted = " or ".join(repr(n) for n in names)
    raise UserError(f"{where}: missing column {wanted} (columns: {', '.join(map(str, row))})")


def structured(value, where: str, name: str):
    """A list/dict column; CSV cells holding JSON or a Python literal are parsed (never run)."""
    if not isinstance(value, str):
        return value
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(value)
        except (ValueError, SyntaxError):
            pass
    raise UserError(f"{where}: column {name!r} is not a list or mapping: {value[:60]!r}")


def read_file(path: str) -> List[dict]:
    """Rows of a local ``.json`` (a list of objects), ``.jsonl`` or ``.csv`` file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"task file {path} does not exist: pass an existing --task_path FILE")
    ext = os.path.splitext(path)[1].lower()
    with open(path, encoding="utf-8", newline="") as f:
        if ext == ".csv":
            data = list(csv.DictReader(f))
        elif ext in (".jsonl", ".ndjson"):
            data = [json.loads(line) for line in f if line.strip()]
        elif ext == ".json":
            text = f.read()
            try:
                data = json.loads(text)
            except json.JSONDecodeError:  # a JSONL file named .json
                data = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            raise UserError(f"task file {path}: unknown format {ext or '(none)'!r}; use .json, .jsonl or "
                            ".csv")
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise UserError(f"task file {path}: expected a list of objects (one per row)")
    return data


def hub_rows(task: str, hub: Hub, split: str, **kw) -> List[dict]:
    """Rows of the public data set through ``datasets`` (imported only here)."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"task {task} reads {hub.repo} through the `datasets` package, which is not "
                          f"installed: pip install datasets, or pass --task_path FILE (JSON, JSONL or CSV)"
                          ) from None
    out: List[dict] = []
    for config in hub.configs:
        out.extend(dict(r) for r in datasets.load_dataset(hub.repo, config, split=hub.split(split), **kw))
    return out


def rows(task: str, hub: Hub, split: str, n: Optional[int], path: Optional[str], kw: Dict) -> List[Row]:
    """The first ``n`` rows (all when None), each with its ``where`` label for errors."""
    if n is not None and n < 1:
        raise UserError(f"task {task}: n={n}; ask for at least one item or pass n=None for all")
    if path is not None:
        data, src = read_file(path), os.path.basename(path)
    else:
        data, src = hub_rows(task, hub, split, **kw), f"{hub.repo}[{hub.split(split)}]"
    data = data if n is None else data[:n]
    return [(f"{src} row {i + 1}", r) for i, r in enumerate(data)]


def build(task: str, hub: Hub, to_item, split: str, n, path, kw) -> List[dict]:
    """Every loader in one line: read the rows and map each with ``to_item(where, row)``."""
    return [to_item(where, row) for where, row in rows(task, hub, split, n, path, kw)]

