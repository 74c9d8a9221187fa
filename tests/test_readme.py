"""README.md's inventory ("What is here") against the tree.

The inventory is two markdown tables whose rows read ``| `FOLDER/` | `a.py`, `b.py`, ... | what |``:
the first cell is one path in backticks (a folder ending in ``/``, or a file), the second every
file of that folder the row names, each in backticks (empty for a row that names none). Checked:

- every file and folder a row names exists;
- every module of ``admm_dist/`` (every ``.py`` file) is named by the row of its folder; a
  package's ``__init__.py`` is covered by its folder's row.

The tree is read when the test runs, so a module added anywhere under ``admm_dist/`` fails here
until its folder's row names it. ``python -m tests.test_readme`` prints what differs.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Set, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
SECTION = "## What is here"
COMPLETE = ("admm_dist",)          # the folders whose every module the inventory must name
TICKED = re.compile(r"`([^`]+)`")


def inventory(text: str) -> Dict[str, List[str]]:
    """{row path: [names in its second cell]} for every table row of the inventory section."""
    start = text.find("\n" + SECTION + "\n")
    assert start >= 0, f"README.md has no '{SECTION}' section (the inventory this test reads)"
    body = text[start + len(SECTION) + 2:]
    nxt = re.search(r"^## ", body, flags=re.M)
    body = body[:nxt.start()] if nxt else body
    rows: Dict[str, List[str]] = {}
    for line in body.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 2:
            continue
        head = TICKED.fullmatch(cells[0])
        if head is None:             # the header and separator rows
            continue
        path = head.group(1).strip()
        assert path not in rows, f"README.md's inventory has two rows for `{path}`"
        rows[path] = [n.strip() for n in TICKED.findall(cells[1])]
    return rows


def listed(rows: Dict[str, List[str]]) -> Tuple[Set[str], Set[str]]:
    """(every path the inventory names, relative to the repository; the folders that have a row)."""
    paths, folders = set(), set()
    for path, names in rows.items():
        paths.add(path.rstrip("/"))
        if path.endswith("/"):
            folders.add(path.rstrip("/"))
            paths.update(os.path.normpath(os.path.join(path, n)) for n in names)
        else:
            assert not names, f"README.md's inventory: the row of the file `{path}` names files: {names}"
    return paths, folders


def tree_modules(top: str) -> Set[str]:
    out = set()
    for d, dirs, files in os.walk(os.path.join(REPO, top)):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not x.startswith("."))
        out.update(os.path.relpath(os.path.join(d, f), REPO) for f in files if f.endswith(".py"))
    return {m.replace(os.sep, "/") for m in out}


def differences() -> Tuple[List[str], List[str]]:
    """(modules in the tree the inventory does not name, names in the inventory the tree lacks)."""
    rows = inventory(open(README, encoding="utf-8").read())
    paths, folders = listed(rows)
    assert any(f == top or f.startswith(top + "/") for top in COMPLETE for f in folders), \
        f"README.md's inventory has no row for a folder of {COMPLETE}: is the table still in '{SECTION}'?"
    unlisted = []
    for mod in sorted(m for top in COMPLETE for m in tree_modules(top)):
        folder, name = os.path.split(mod)
        if mod in paths or (name == "__init__.py" and folder in folders):
            continue
        unlisted.append(f"{mod} (a package: give `{folder}/` a row)" if name == "__init__.py" else mod)
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(REPO, p)))
    return unlisted, missing


def test_the_readme_inventory_matches_the_tree():
    unlisted, missing = differences()
    problems = []
    if unlisted:
        problems.append("modules that README.md's inventory ('What is here') does not name:\n    "
                        + "\n    ".join(unlisted)
                        + "\n  fix: add it to README.md's inventory, in backticks in the row of its folder"
                          " (`name.py` in the second cell of the row `folder/`), and say in a few words what it holds")
    if missing:
        problems.append("paths README.md's inventory names that are not in the tree:\n    "
                        + "\n    ".join(missing)
                        + "\n  fix: remove it from README.md's inventory, or correct its name there")
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    u, m = differences()
    print("not in the inventory:", *(u or ["(none)"]), sep="\n  ")
    print("not in the tree:", *(m or ["(none)"]), sep="\n  ")
