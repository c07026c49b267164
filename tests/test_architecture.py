"""The house's floor rules (../shared/DESIGN.md), checked on the source: imports and module sizes.

Every import is read from the AST of every module — top-level and inside functions alike, and
``importlib.import_module("...")`` / ``__import__("...")`` calls with a literal name, since a
lazy or dynamic import reaches up just the same. Plug-ins found through entry points are named
in pyproject.toml, not in the code, and are what lets the ground floor stay ground.
"""

from __future__ import annotations

import ast
import re
import sys
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


def _private_crossings(mod: str, path: Path) -> list[str]:
    """Where ``mod`` reaches into another top-level package's private parts: a ``_module`` of it
    (``from kvevents.transport.nats._loop import X``, ``import consumers._fastpath``, a literal
    ``import_module``) or a ``_name`` taken from one of its modules (``from consumers.keys import
    _FAST``). A package's own private modules (``consumers._accel`` in ``consumers``) are its own
    business; another package gets the public name or asks for one to be made."""
    top = mod.split(".")[0]
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    bad = [f"{rel}:{line} imports {name}" for name, line in _imported_names(mod, path)
           if name.split(".")[0] in PACKAGES and name.split(".")[0] != top
           and any(part.startswith("_") for part in name.split(".")[1:])]
    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in PACKAGES and node.module.split(".")[0] != top:
                bad += [f"{rel}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and f"{node.module}.{a.name}" not in MODULES.keys() | EXTENSIONS]
    return bad


def test_no_package_imports_another_packages_private_parts():
    """``kvservice`` (or any package) uses what ``kvevents``/``consumers``/``manager`` publish;
    a private module or name is free to change under its own package's tests only."""
    bad = [b for mod, path in MODULES.items() for b in _private_crossings(mod, path)]
    assert bad == []


def test_the_private_import_check_finds_one(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("from kvevents.transport.nats._loop import LoopThread\n"
                    "def f():\n    import consumers._fastpath\n"
                    "from consumers.keys import _FAST\nfrom consumers import _accel\n"
                    "from ._private import ok\nfrom kvservice._mine import ok2\n"
                    "from kvevents.transport.nats.loop import LoopThread\n")
    found = _private_crossings("kvservice.probe", path)
    assert sorted(f.split(" imports ")[1] for f in found) == [
        "consumers._accel", "consumers._fastpath", "consumers.keys._FAST", "kvevents.transport.nats._loop"]


def _topic_writes(path: Path) -> list[str]:
    """Where ``path`` changes an object's ``topic``: ``x.topic = ...`` (plain, augmented,
    annotated or unpacked), ``setattr(x, "topic", ...)``, or ``replace(x, topic=...)``."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    bad = []

    def targets(t: ast.AST):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets(e)
        elif isinstance(t, ast.Starred):
            yield from targets(t.value)
        else:
            yield t

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        found = []
        if isinstance(node, ast.Assign):
            found = [t for tgt in node.targets for t in targets(tgt)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            found = [node.target]
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            found = list(targets(node.target))
        if any(isinstance(t, ast.Attribute) and t.attr == "topic" for t in found):
            bad.append(f"{rel}:{getattr(node, 'lineno', '?')}: assigns .topic")
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name == "setattr" and len(node.args) > 1 and _literal(node.args[1]) == "topic":
                bad.append(f"{rel}:{node.lineno}: setattr .topic")
            if name == "replace" and any(k.arg == "topic" for k in node.keywords):
                bad.append(f"{rel}:{node.lineno}: replace(topic=...)")
    return bad


def test_the_service_never_rewrites_a_deliverys_topic():
    """A delivery's topic is what the engine sent; the router is told once which pod (and model)
    a publisher is (``KVRouter.attribute``), so nothing in the service rewrites a topic for the
    feed to parse back (issue 25)."""
    bad = [b for mod, path in MODULES.items() if mod.split(".")[0] == "kvservice" for b in _topic_writes(path)]
    assert bad == []


def test_the_topic_write_check_finds_one(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def take(d, e, f, g):\n    d.topic = 'kv@a@m'\n    e.topic += 'x'\n"
                    "    f.seq, g.topic = 1, 'y'\n    setattr(d, 'topic', 'z')\n    replace(d, topic='w')\n"
                    "    topic = d.topic\n    d.seq = 2\n")
    assert sorted(int(b.split(": ", 1)[0].rsplit(":", 1)[1]) for b in _topic_writes(path)) == [2, 3, 4, 5, 6]


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


# --- the documentation: a short README, the rest as pages in docs/, every relative link live ---

README_MAX_LINES = 600
#: the user guide's pages (docs/); each is linked from the README's documentation table
DOC_PAGES = ("architecture.md", "benchmarks.md", "deploy-vllm.md", "event-plane.md", "failure-model.md",
             "manager.md", "metrics.md", "router.md", "router-service.md", "storage-tier.md",
             "wire-and-transport.md")
#: pages written on other branches at the same time, linked already: a link to one of these may
#: dangle until those branches are merged (the lead then empties this set)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md")),
            *sorted((ROOT / "dashboards").glob("*.md"))]


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans (a link inside code is not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a markdown file (duplicates get -1, -2, ...)."""
    out: set[str] = set()
    for title in re.findall(r"^#{1,6} +(.+?) *#*$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        base, n = slug, 0
        while slug in out:
            n += 1
            slug = f"{base}-{n}"
        out.add(slug)
    return out


def _dead_links(path: Path) -> list[str]:
    dead = []
    text = path.read_text()
    for target in _LINK.findall(_prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:: not ours to check
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            dead.append(f"{target} (no {rel})")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            dead.append(f"{target} (no heading #{anchor} in {rel})")
    return dead


def test_the_readme_is_a_short_guide_and_the_rest_is_in_docs():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move the detail to a docs/ page"
    missing = [p for p in DOC_PAGES if not (ROOT / "docs" / p).is_file()]
    assert not missing, f"docs pages missing: {missing}"
    readme_links = {t.partition("#")[0] for t in _LINK.findall(_prose((ROOT / "README.md").read_text()))}
    unlinked = [p for p in DOC_PAGES if f"docs/{p}" not in readme_links]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    dead = _dead_links(path)
    assert not dead, f"{path.relative_to(ROOT)}: dead links: {dead}"


def test_the_link_checker_finds_dead_links_and_anchors(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Some `code` (here)\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md) [ok](docs/a.md#some-code-here) [gone](docs/b.md) [bad](docs/a.md#nope)\n"
                    "[web](https://example.com) `[code](docs/c.md)`\n")
    assert _dead_links(page) == ["docs/b.md (no docs/b.md)", "docs/a.md#nope (no heading #nope in docs/a.md)"]


#: a package being built on another branch, named in the docs already (the lead empties this)
_PATH = re.compile(r"`((?:kvevents|manager|consumers|kvservice|kvdemo|kvevents_vllm|benchmarks|tests|dashboards)"
                   r"/[\w./-]*)`")


def test_every_source_path_the_docs_name_exists():
    """A module named in the README or a docs page (`manager/wire.py`, `kvevents/transport/zmq/`)
    is where the page says: a renamed or moved module shows up here, not in a newcomer's search."""
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in sorted(set(_PATH.findall(page.read_text()))):
            if not (ROOT / path.rstrip("/")).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths named in the docs that do not exist: " + "; ".join(missing)


# --- the router's Index role (issue 25): a handful of verbs in routing terms ---------------------------------

_STORAGE_WORDS = ("bit", "lane", "slot", "grow", "mask", "walk", "native", "table", "cap")


def test_the_index_role_is_a_few_verbs_in_routing_terms():
    from consumers.index import Index

    verbs = sorted(Index.__abstractmethods__)
    assert len(verbs) <= 8, verbs
    assert not [v for v in verbs if any(w in v for w in _STORAGE_WORDS)], verbs
    public = [n for n in dir(Index) if not n.startswith("_")]
    assert not [n for n in public if any(w in n for w in _STORAGE_WORDS)], public


def test_index_backends_are_siblings_and_decorators_hold_no_capability():
    from consumers.index import INDEX_BACKENDS, Index
    from consumers.instrumented import IndexDecorator, InstrumentedIndex, TracedIndex

    backends = [INDEX_BACKENDS.get(n) for n in INDEX_BACKENDS.names()]
    assert len(backends) >= 2
    for a in backends:
        assert issubclass(a, Index) and not a.__abstractmethods__
        assert not [b for b in backends if b is not a and issubclass(a, b)], a
    # the C table is the native backend's capability, asked for once by the router: a decorator
    # forwards the verbs and nothing else
    for d in (IndexDecorator, InstrumentedIndex, TracedIndex):
        assert not [n for n in vars(d) if any(w in n for w in ("native", "table", "accelerator", "__getattr__"))], d
# ---- one production path per operation: no hand-bound libraries, one fast-path switch (issue 25) ----

#: every file that is built or shipped: the packages' sources and the build script
_SOURCES = sorted(p for pkg in PACKAGES for ext in ("py", "c", "h", "pyx", "pxd") for p in (ROOT / pkg).rglob(f"*.{ext}"))
_SOURCES.append(ROOT / "setup.py")
#: the one switch between a C path and its Python reference, and the test harness's corpus place
SWITCHES = {"KVEVENTS_PURE_PYTHON", "KVEVENTS_SHARED"}
#: settings read from the environment that choose no code path (each says what it sets)
SETTINGS = {
    "KVEVENTS_TRACE_SAMPLE_EVERY": "the default trace sampling interval (kvevents.telemetry.sampling)",
    "KVEVENTS_NATS_SERVER": "the nats-server binary the JetStream broker starts",
    "KVEVENTS_CAPTURE": "the contract plugin's conformance capture directory",
    "KVEVENTS_VLLM_SHM_DIR": "where the vLLM plugin's shared host buffer files go (default /dev/shm)",
}


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _hand_binding_lines(paths) -> list[str]:
    words = ("dl" + "open", "dl" + "sym")  # (spelt apart: this file is not one of the sources anyway)
    return [f"{_rel(p)}:{n}: {line.strip()}" for p in paths
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if any(w in line for w in words)]


def test_no_library_is_bound_by_hand():
    """Other libraries are reached through their supported routes (an import, a declared build
    dependency), never by dlopen/dlsym of a file found at run time."""
    assert _hand_binding_lines(_SOURCES) == []


def test_the_hand_binding_check_finds_one(tmp_path):
    bad = tmp_path / "x.c"
    bad.write_text('void *h = dl' + 'open("libzmq.so", RTLD_NOW);\n')
    assert len(_hand_binding_lines([bad])) == 1


def _env_names(paths) -> list[tuple[str, str]]:
    """(file:line, name) for every KVEVENTS_* variable a Python source names as a string, and
    every getenv() of a C source (a C switch of any name)."""
    out = []
    for p in paths:
        text = p.read_text(errors="replace")
        if p.suffix == ".py":
            for node in ast.walk(ast.parse(text, str(p))):
                # a string that is a variable's name (prose that mentions one is not a read)
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    m = re.fullmatch(r"\$?(KVEVENTS_[A-Z0-9_]+)", node.value.strip())
                    if m:
                        out.append((f"{_rel(p)}:{node.lineno}", m.group(1)))
        else:
            for n, line in enumerate(text.splitlines(), 1):
                if re.search(r"\bgetenv\s*\(", line):
                    out.append((f"{_rel(p)}:{n}", "getenv"))
    return out


def test_kvevents_pure_python_is_the_only_fast_path_switch():
    """No environment variable picks between twin implementations except KVEVENTS_PURE_PYTHON
    (the C extension vs its Python reference); the others named are settings, listed above."""
    unknown = [(where, name) for where, name in _env_names(_SOURCES) if name not in SWITCHES | SETTINGS.keys()]
    assert unknown == []


def test_the_switch_check_finds_python_and_c_switches(tmp_path):
    py = tmp_path / "m.py"
    py.write_text('import os\nFAST = os.environ.get("KVEVENTS_ZMQRECV", "1") != "0"\nOK = os.getenv("KVEVENTS_PURE_PYTHON")\n')
    c = tmp_path / "m.h"
    c.write_text('const char *off = getenv("KVEVENTS_NO_SIMD");\n')
    found = _env_names([py, c])
    assert [n for _, n in found if n not in SWITCHES] == ["KVEVENTS_ZMQRECV", "getenv"]
