"""natsched's packages import downward only, and no two of them import each other, read from the files.

The layers, lowest first (an import may go down or stay within its own package, never up)::

    errors stats tracing         the root error, the one percentile, traces; import nothing of ours
    wire                         the wire contract
    bus                          the NATS transport
    client audit admitter router workers sim gateway     features and services
    hosting ops bench            running processes, operations, benchmarks
    cli                          the command line

Packages of one layer may use each other, but never in a cycle. The graph comes from ``ast``
over every file under ``natsched/`` (imports inside functions count; ``if TYPE_CHECKING:``
imports too). ``natsched/__init__.py`` (the curated public names, loaded lazily from
``client``) and ``natsched/__main__.py`` (``python -m natsched``: the CLI) are the two doors
into the tree and stand outside the layers. "Only ``bus`` imports nats" and "``wire`` imports
nothing of ours" are checked in ``tests/test_layering.py``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "natsched"
DOORS = {"__init__", "__main__"}
LAYERS = [
    {"errors", "stats", "tracing"},
    {"wire"},
    {"bus"},
    {"client", "audit", "admitter", "router", "workers", "sim", "gateway"},
    {"hosting", "ops", "bench"},
    {"cli"},
]
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def _imported_packages(tree: ast.AST):
    """(package, line) for every ``natsched.<package>`` the module imports, wherever the statement is."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "natsched" and len(parts) > 1:
                    yield parts[1], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "natsched":
                continue
            if len(parts) > 1:
                yield parts[1], node.lineno
            else:  # from natsched import wire, errors
                for alias in node.names:
                    yield alias.name, node.lineno


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package -> the places ("natsched/x/y.py:12") that make the edge."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        importer = _package_of(path)
        if importer in DOORS:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for imported, line in _imported_packages(tree):
            if imported != importer:
                edges[(importer, imported)].append(f"{path.relative_to(ROOT.parent)}:{line}")
    return dict(edges)


def _cycles(edges) -> list[list[str]]:
    """Every strongly connected group of more than one package (Tarjan), each with a path around it."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_every_package_has_a_layer():
    packages = {_package_of(p) for p in ROOT.rglob("*.py")} - DOORS
    assert packages <= set(LEVEL), f"packages without a layer (add them to LAYERS): {sorted(packages - set(LEVEL))}"


def test_no_upward_imports():
    upward = [f"{a} -> {b} ({', '.join(places)})" for (a, b), places in sorted(import_edges().items())
              if LEVEL.get(b, -1) > LEVEL.get(a, -1)]
    assert not upward, "imports against the layers:\n  " + "\n  ".join(upward)


def test_no_import_cycles_between_packages():
    edges = import_edges()
    report = []
    for group in _cycles(edges):
        inside = [f"{a} -> {b} ({', '.join(edges[(a, b)])})" for a in group for b in group if (a, b) in edges]
        report.append(" <-> ".join(group) + ":\n    " + "\n    ".join(inside))
    assert not report, "import cycles between packages:\n  " + "\n  ".join(report)


def test_the_graph_sees_imports_inside_functions(tmp_path):
    """The reader is not blind to the imports the layers most often hide in (function bodies)."""
    tree = ast.parse("def f():\n    from natsched.cli.options import fail\n"
                     "import natsched.bus.connection\nfrom natsched import wire\n")
    assert sorted(_imported_packages(tree)) == [("bus", 3), ("cli", 2), ("wire", 4)]
