"""No import cycle inside the nsa package.

Edges are the imports a module runs when it is loaded (module level, including try/except and plain
if blocks, excluding `if TYPE_CHECKING:`); with lazy=True also the imports inside functions (a lazy
cycle, e.g. a dispatcher and a kernel module importing each other inside functions, still ties two
layers together). For
`from pkg import name` the edge goes to pkg.name when that is a module, else to pkg. Parent packages
are not edges of their children (Python loads them first either way).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "nsa"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted((ROOT / PKG).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _top_level(body: list[ast.stmt]):
    """Import statements executed at load time (descends into if/try/with, not into defs)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name != "TYPE_CHECKING":
                yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level(part)
        elif isinstance(node, ast.With):
            yield from _top_level(node.body)


def _all_imports(body: list[ast.stmt]):
    for node in body:
        yield from (n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    """module -> the nsa modules it imports at load time (lazy: or anywhere in its code)."""
    imports = _all_imports if lazy else _top_level
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            for t in targets:
                while t and t not in mods and "." in t:   # `import nsa.ops.x` where x is an attribute
                    t = t.rpartition(".")[0]
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_graph_sees_known_edges():
    g = import_graph()
    assert "nsa.ops.tuning" in g["nsa.ops.dispatch"] and "nsa.ops.plan" in g["nsa.ops.triton.function"]
    assert "nsa.ops.triton.attn" in g["nsa.ops.triton.function"]


def test_finder_reports_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_nsa():
    cycles = find_cycles(import_graph())
    assert cycles == [], f"import cycles in nsa/: {cycles}"


def test_no_import_cycle_in_nsa_even_through_lazy_imports():
    cycles = find_cycles(import_graph(lazy=True))
    assert cycles == [], f"import cycles in nsa/ (counting imports inside functions): {cycles}"
