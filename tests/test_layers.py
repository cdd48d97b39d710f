"""Import structure of the package: imports point down only.

Every module of ``trapetum/`` is parsed with ``ast`` (nothing is imported); every import of one of trapetum's
own modules counts, at the top of a file or inside a function (``from .x import y``, ``from .. import y``,
``import trapetum.x``). A *room* is a top-level module or package of ``trapetum/``; the rooms stand on the
floors of ``FLOORS`` (top first), and a room may import the rooms of the floors below its own, never one
above, and never one of its own floor (except the pairs of ``SAME_FLOOR``, each with its reason). Checked:

* every room of the tree has a floor (a new room must be placed);
* per room, its imports point down (``test_room_imports_point_down[room]``); the rooms of ``STILL_UP``
  are known to import upwards while the restructuring goes on, and are expected to fail (not strictly:
  a room that got fixed shows as XPASS; then drop it from ``STILL_UP``);
* the whole tree: no cycle between rooms and every import pointing down (expected to fail while
  ``STILL_UP`` is not empty).

Failure messages list each offending import as ``file:line: source text  (room -> room)``.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trapetum"

FLOORS: list[tuple[str, ...]] = [  # top first
    ("cli",),
    ("commands",),
    ("serve", "eval"),
    ("api", "quant"),
    ("runtime", "formats"),
    ("models", "tokenizer"),
    ("schemes",),
    ("kernels",),
    ("chat_template", "template_child"),  # bounded template rendering (the child process runs jinja2 alone)
    ("settings", "errors", "jsondepth", "_version", "cpu_threads"),
]
ROOT_ROOM = "api"  # trapetum/__init__.py: the API's facade (``trapetum.load``), so it stands where api stands
SAME_FLOOR = {  # (importer, imported) within one floor, and why
    ("settings", "errors"): "settings raises ConfigError, the error type of every bad switch",
    ("api", "quant"): "trapetum.sparsify (the facade in trapetum/__init__.py) runs quant/sparsify.py's calibration",
}
STILL_UP: dict[str, str] = {  # room -> its imports that still point up (none left: the restructuring is done)
}

FLOOR_OF = {room: i for i, floor in enumerate(FLOORS) for room in floor}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room_of(module: str) -> str:
    parts = module.split(".")
    return ROOT_ROOM if len(parts) == 1 else parts[1]


def _resolve(target: str) -> str | None:
    """The trapetum module an import names (a name inside a module counts as the module)."""
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target if target in MODULES else None


def _imports(module: str, path: Path):
    """(target module, line number, source line) for every import of a trapetum module in ``path``."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(text, str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in dict.fromkeys(names):
            if name.split(".")[0] == "trapetum" and (target := _resolve(name)) is not None:
                yield target, node.lineno, lines[node.lineno - 1].strip()


def _edges() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> the import lines, for rooms that differ."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in MODULES.items():
        for target, line, src in _imports(module, path):
            a, b = room_of(module), room_of(target)
            if a != b:
                edges[(a, b)].append(f"{path.relative_to(PACKAGE.parent)}:{line}: {src}  ({a} -> {b})")
    return edges


EDGES = _edges()


def _upward(edges, rooms) -> list[str]:
    bad = []
    for (a, b), where in sorted(edges.items()):
        if a not in rooms or (a, b) in SAME_FLOOR:
            continue
        if a not in FLOOR_OF or b not in FLOOR_OF or FLOOR_OF[b] <= FLOOR_OF[a]:
            bad += where
    return bad


def _cycles(edges) -> list[list[str]]:
    """Strongly connected sets of more than one room (Tarjan), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_parser_sees_the_known_imports():
    flat = [w for where in EDGES.values() for w in where]
    assert any(w.startswith("trapetum/cli.py:") and "(cli -> commands)" in w for w in flat)  # from . import commands
    assert ("commands", "quant") in EDGES and ("formats", "models") in EDGES
    assert ("quant", "formats") in EDGES  # function-local imports count too
    assert all(room_of(m) in FLOOR_OF for m in MODULES if m != "trapetum")


def test_every_room_has_a_floor():
    rooms = {room_of(m) for m in MODULES}
    assert rooms - set(FLOOR_OF) == set(), "rooms without a floor in FLOORS"
    assert all(a in FLOOR_OF and FLOOR_OF[a] == FLOOR_OF[b] for a, b in SAME_FLOOR)
    assert set(STILL_UP) <= set(FLOOR_OF)


@pytest.mark.parametrize("room", [
    pytest.param(r, marks=pytest.mark.xfail(strict=False, reason=STILL_UP[r])) if r in STILL_UP else r
    for floor in FLOORS for r in floor])
def test_room_imports_point_down(room):
    bad = _upward(EDGES, {room})
    assert not bad, f"{room} imports rooms on its own floor or above:\n" + "\n".join(bad)


@pytest.mark.xfail(bool(STILL_UP), strict=False, reason="still importing upwards: " + "; ".join(STILL_UP.values()))
def test_whole_tree_has_no_cycles_and_points_down():
    cycles = _cycles({e: w for e, w in EDGES.items() if e not in SAME_FLOOR})
    bad = _upward(EDGES, set(FLOOR_OF))  # every cycle holds at least one of these
    assert not cycles and not bad, "\n".join([f"cycle between rooms: {' <-> '.join(c)}" for c in cycles]
                                             + ["imports that point up:"] + bad)
