"""The package's layers, read from the source (no module is imported).

``docs/design.rst`` ("Module layout") draws them.  Every import counts: at
module level, inside functions, under ``TYPE_CHECKING``.  Two rules:

1. each module imports only modules of its own layer or of layers below it
   (so nothing below the façade imports ``fully_sharded_data_parallel``);
2. no import circles, within a layer either.

A new module must be placed in :data:`LAYERS` (a prefix of its name) before
this test passes, which is the point: deciding where it sits.
"""

from __future__ import annotations

import ast
import os

PKG = "fsdp_wrap"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PKG)

# bottom to top; a module belongs to the longest prefix that names it
LAYERS: list[tuple[str, list[str]]] = [
    ("public settings, version checks", ["fsdp_wrap.api", "fsdp_wrap._compat"]),
    ("communication", ["fsdp_wrap.comm"]),
    ("the handle", ["fsdp_wrap.handle"]),
    ("the runtime", ["fsdp_wrap.runtime"]),
    ("state dicts", ["fsdp_wrap.state_dict"]),
    ("wrap policies and the auto-wrap pass", ["fsdp_wrap.wrap"]),
    ("the façade", ["fsdp_wrap.fully_sharded_data_parallel", "fsdp_wrap.sharded_grad_scaler"]),
    ("checkpoints and planning", ["fsdp_wrap.checkpoint", "fsdp_wrap.planning"]),
    (
        "the install step and the applications",
        ["fsdp_wrap.frameworks", "fsdp_wrap.cli", "fsdp_wrap.demo", "fsdp_wrap.cli.testbed",
         "fsdp_wrap.cli.timeline", "fsdp_wrap.__main__", "fsdp_wrap"],
    ),
]


def _modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports (``from pkg import sub`` counts
    ``pkg`` and ``pkg.sub``, as Python runs ``pkg/__init__`` first; the
    package root itself is left out, as every import runs it)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = base + ("." + node.module if node.module else "")
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            # (every import runs fsdp_wrap/__init__ first: an edge to it says nothing)
            if t and t != name and t != PKG:
                found.add(t)
    return found


def _layer(name: str) -> int:
    best = (-1, -1)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if name == p or name.startswith(p + "."):
                best = max(best, (len(p), i))
    return best[1]


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in _graph() if _layer(m) < 0)
    assert not unplaced, f"place these modules in tests/test_layers.py LAYERS: {unplaced}"


def test_each_module_imports_only_its_layer_and_below() -> None:
    upward = [
        f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
        for a, targets in sorted(_graph().items())
        for b in sorted(targets)
        if _layer(b) > _layer(a)
    ]
    assert not upward, "imports going up a layer:\n" + "\n".join(upward)


def test_no_import_circles() -> None:
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_rule_reads_real_imports() -> None:
    """The reader itself: what it finds for two modules whose imports are known."""
    graph = _graph()
    assert "fsdp_wrap.runtime.state" in graph["fsdp_wrap.fully_sharded_data_parallel.facade"]
    assert "fsdp_wrap.handle.flat_param" in graph["fsdp_wrap.runtime.setup"]
    assert _layer("fsdp_wrap.comm.collectives") < _layer("fsdp_wrap.fully_sharded_data_parallel")
