"""The house's floor rules (../shared/DESIGN.md), checked on the source: imports and module sizes.

Every import is read from the AST of every module — top-level and inside functions alike, and
``importlib.import_module("...")`` / ``__import__("...")`` calls with a literal name, since a
lazy or dynamic import reaches up just the same. Plug-ins found through entry points are named
in pyproject.toml, not in the code, and are what lets the ground floor stay ground.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvevents", "manager", "consumers", "kvdemo", "kvservice", "kvevents_vllm")
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()
#: compiled extension modules (``consumers/_fastpath.c`` -> ``consumers._fastpath``): importable, importing nothing here
EXTENSIONS = {".".join(p.relative_to(ROOT).with_suffix("").parts) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.c")}


def _walk(tree: ast.AST):
    """Every node, ``if TYPE_CHECKING:`` bodies included: an import made only for annotations
    still ties the two modules together (a type checker follows it), so it counts as an edge."""
    return ast.walk(tree)


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _imported_names(mod: str, path: Path) -> list[tuple[str, int]]:
    """Dotted names ``mod`` imports, with line numbers (relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = []
    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            prefix = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in MODULES.keys() | EXTENSIONS]
            out += [(name, node.lineno) for name in subs]
            if len(subs) < len(node.names):  # some name is an attribute of the module ``prefix`` itself
                out.append((prefix, node.lineno))
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name in ("import_module", "__import__") and node.args and _literal(node.args[0]):
                target = _literal(node.args[0])
                if target.startswith(".") and len(node.args) > 1 and _literal(node.args[1]):
                    target = _literal(node.args[1]) + target
                out.append((target, node.lineno))
    return out


def _edges() -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line}."""
    graph: dict[str, dict[str, int]] = {}
    for mod, path in MODULES.items():
        deps = graph.setdefault(mod, {})
        for name, line in _imported_names(mod, path):
            if name in EXTENSIONS:
                continue
            while name and name not in MODULES:  # "pkg.mod.attr" -> "pkg.mod"
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps.setdefault(name, line)
    return graph


GRAPH = _edges()


def _floor_violations(src_pkgs: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    return [f"{MODULES[m].relative_to(ROOT)}:{line} imports {d}"
            for m, deps in GRAPH.items() if m.split(".")[0] in src_pkgs
            for d, line in deps.items() if d.split(".")[0] in banned]


def test_the_walker_sees_lazy_and_dynamic_imports(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    import manager.base\n"
                    "import importlib\nimportlib.import_module('kvdemo.cluster')\n"
                    "from importlib import import_module\nimport_module('.feed', 'consumers')\n"
                    "from . import source\n"
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .router_only import X\n")
    names = {n for n, _ in _imported_names("kvevents.probe", path)}
    assert {"manager.base", "kvdemo.cluster", "consumers.feed", "kvevents.source", "kvevents.router_only"} <= names
    assert "kvservice.api" not in names


TOP_FLOORS = ("kvdemo", "kvservice", "kvevents_vllm")


def test_kvevents_is_the_ground_floor():
    assert _floor_violations(("kvevents",), ("manager", "consumers", *TOP_FLOORS)) == []


def test_manager_and_consumers_never_import_each_other_or_the_top_floor():
    assert _floor_violations(("manager",), ("consumers", *TOP_FLOORS)) == []
    assert _floor_violations(("consumers",), ("manager", *TOP_FLOORS)) == []


def test_the_vllm_plugin_is_a_top_floor_of_its_own():
    """Nothing imports ``kvevents_vllm`` (vLLM finds it through its entry point), and it imports
    only the floors below it."""
    others = tuple(p for p in PACKAGES if p != "kvevents_vllm")
    assert _floor_violations(others, ("kvevents_vllm",)) == []
    assert _floor_violations(("kvevents_vllm",), ("kvdemo", "kvservice")) == []


def test_only_the_vllm_plugin_imports_vllm():
    """vLLM is an optional extra (``kvevents[vllm]``): every difference between its releases
    lives in ``kvevents_vllm``, and no other package may reach for it."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}"
           for mod, path in MODULES.items() if mod.split(".")[0] != "kvevents_vllm"
           for name, line in _imported_names(mod, path) if name.split(".")[0] == "vllm"]
    assert bad == []
    assert any(name.split(".")[0] == "vllm" for mod, path in MODULES.items() if mod.startswith("kvevents_vllm")
               for name, _ in _imported_names(mod, path))  # (the check can see a vllm import)


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_circle_finder_finds_circles():
    g = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {"f": 1}, "f": {"e": 1}}
    assert sorted(_cycles(g)) == [["a", "b", "c"], ["e", "f"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_circles():
    cycles = _cycles(GRAPH)
    assert cycles == [], "import circles (each works only by import order): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for ext in ("*.py", "*.c", "*.h") for p in (ROOT / pkg).rglob(ext))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_500_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines: it has two rooms in it; split it by role"
