"""The package's architecture, checked from its source: layers import only downwards, no import
cycle (type-only imports included), no private name used across modules, nothing at the top of
``admm_dist/`` but the package's face and the entry-point shims, matplotlib only in the plots
layer, one module that creates process groups, and no line over 110 characters (package and
benchmarks). Modules are sized by their concept, not by a cap.

The same check runs by hand: ``python -m tests.test_layers`` prints the import graph's
cycles, the layer violations and the largest modules.
"""
from __future__ import annotations

import ast
import os
import sys
from typing import Dict, List, Set, Tuple

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "admm_dist")
LAYERS = ("core", "engine", "model", "tasks", "data", "mas", "training", "demo", "plots", "cli", "bench")
TOP_LEVEL = {"__init__", "train", "evaluate", "plot", "plan"}   # the face and the entry-point shims
MAX_LINE = 110
GROUP_MAKERS = ("new_group", "init_process_group", "init_device_mesh", "DeviceMesh", "split_group")


def modules() -> Dict[str, str]:
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _type_checking_blocks(tree: ast.AST) -> Set[int]:
    """ids of import nodes under ``if TYPE_CHECKING:`` (type-only back-references)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for n in ast.walk(sub):
                    skip.add(id(n))
    return skip


def imports(mods: Dict[str, str], type_only: bool = False) -> Dict[str, List[Tuple[str, List[str]]]]:
    """{module: [(imported module, names imported from it)]}, function-local imports included, and
    with ``type_only`` those under ``if TYPE_CHECKING:`` too."""
    out: Dict[str, List[Tuple[str, List[str]]]] = {m: [] for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read())
        skip = set() if type_only else _type_checking_blocks(tree)
        is_pkg = path.endswith("__init__.py")
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                out[mod] += [(a.name, []) for a in node.names if a.name in mods]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod if is_pkg else mod.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        base = base.rsplit(".", 1)[0]
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                if target not in mods:
                    continue
                names = []
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:      # a submodule: the edge is to it, not to the package face
                        out[mod].append((sub, []))
                    else:
                        names.append(a.name)
                if names:
                    out[mod].append((target, names))
    return out


def layer_of(mod: str) -> int:
    parts = mod.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _graph(type_only: bool = False):
    mods = modules()
    imp = imports(mods, type_only)
    graph = {m: {t for t, _ in imp[m] if t != m} for m in mods}
    return mods, imp, graph


def test_no_import_cycle():
    _, _, graph = _graph(type_only=True)
    assert cycles(graph) == []


def test_layers_import_only_downwards():
    _, imp, _ = _graph()
    bad = [f"{m} (layer {LAYERS[layer_of(m)]}) imports {t}" for m in imp for t, _ in imp[m]
           if layer_of(t) > layer_of(m) and t != "admm_dist"]
    assert bad == []


def test_every_module_is_in_a_layer():
    mods = modules()
    flat = sorted(m for m in mods if m.count(".") == 1 and m.split(".")[1] not in LAYERS)
    assert {m.split(".")[1] for m in flat} <= TOP_LEVEL, flat


def test_no_private_name_crosses_modules():
    _, imp, _ = _graph()
    bad = [f"{m} imports {n} from {t}" for m in imp for t, names in imp[m] for n in names
           if n.startswith("_") and not n.startswith("__")]
    assert bad == []


def test_no_line_over_110_characters():
    top = os.path.dirname(ROOT)
    paths = list(modules().values()) + [os.path.join(top, "benchmarks", f)
                                         for f in sorted(os.listdir(os.path.join(top, "benchmarks")))
                                         if f.endswith(".py")]
    long = [f"{os.path.relpath(p, top)}:{i}" for p in paths
            for i, line in enumerate(open(p, encoding="utf-8"), 1) if len(line.rstrip("\n")) > MAX_LINE]
    assert long == [], f"{len(long)} line(s) over {MAX_LINE} characters: {long[:20]}"


def test_one_module_creates_process_groups_and_meshes():
    """engine/dist.py forms the default and control groups and builds the mesh of a placement
    (:func:`admm_dist.engine.dist.build_mesh`); everything else takes its groups from them."""
    makers = sorted({mod for mod, path in modules().items()
                     for node in ast.walk(ast.parse(open(path, encoding="utf-8").read()))
                     if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) in GROUP_MAKERS
                                                        or getattr(node.func, "id", None) in GROUP_MAKERS)})
    assert makers == ["admm_dist.engine.dist"], makers


def test_only_the_plots_layer_imports_matplotlib():
    """matplotlib is an extra (``admm_dist[plot]``): nothing else may need it."""
    users = []
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "matplotlib" for n in names):
                users.append(mod)
    assert users and all(m.startswith("admm_dist.plots.") for m in users), users


def test_one_communication_layer_with_two_transports():
    """Each consensus algorithm is written once (an object of engine/comm/algorithm.py's kind),
    over two concrete communicators: one in-process, one over a process group."""
    comm = {m: p for m, p in modules().items() if m.startswith("admm_dist.engine.comm")}
    classes = sorted(node.name for p in comm.values()
                     for node in ast.walk(ast.parse(open(p, encoding="utf-8").read()))
                     if isinstance(node, ast.ClassDef) and node.name.endswith("Communicator"))
    assert classes == ["Communicator", "LocalCommunicator", "ProcessGroupCommunicator"], classes


def test_agreement_never_rides_the_consensus_path():
    """training/ and the preemption agreement ask engine/control.py, never the communicator's
    gather_rows (or any other communicator call that moves rows)."""
    users = []
    for mod, path in modules().items():
        if mod.startswith("admm_dist.training.") or mod == "admm_dist.engine.preemption":
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.Attribute) and node.attr in ("gather_rows", "exchange", "consensus_"):
                    users.append(f"{mod}: .{node.attr}")
    assert users == []


def test_every_package_says_what_it_owns():
    mods = modules()
    missing = [m for m, p in mods.items() if p.endswith("__init__.py")
               and ast.get_docstring(ast.parse(open(p, encoding="utf-8").read())) is None]
    assert missing == []


if __name__ == "__main__":
    mods, imp, graph = _graph(type_only=True)
    print("import cycles (type-only imports included):", cycles(graph) or "none")
    for m in sorted(imp):
        for t, _ in imp[m]:
            if layer_of(t) > layer_of(m) and t != "admm_dist":
                print(f"upward: {m} -> {t}")
    sizes = sorted(((sum(1 for _ in open(p, encoding="utf-8")), m) for m, p in mods.items()), reverse=True)
    print("largest modules:", ", ".join(f"{m} {n}" for n, m in sizes[:8]))
