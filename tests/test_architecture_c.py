"""Architecture rules for the C sources and the one C path per operation (with
tests/test_architecture.py's for the Python modules).

* Each header under ``consumers/`` holds one role and includes no project header: the one
  ``.c`` file that uses them (``consumers/_fastpath.c``) lists them all in its include block at
  its top, before its first line of code, in the order they build on each other. No header
  pulls in "the next chapter" at its end.
* ``consumers/scorer.py`` picks a score path on one thing only, whether the C table is there
  (the native index over the C extension): no ``getattr(_FAST, ...)``/``hasattr`` probing for
  twins, no size condition that silently takes another path.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSUMERS = ROOT / "consumers"
_PROJECT_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line that is neither blank, a comment nor a preprocessor
    directive (block comments spanning lines included)."""
    out, in_comment = [], False
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if in_comment:
            if "*/" in s:
                in_comment = False
                s = s.split("*/", 1)[1].strip()
            else:
                continue
        while s.startswith("/*"):
            if "*/" not in s:
                in_comment = True
                s = ""
                break
            s = s.split("*/", 1)[1].strip()
        if s and not s.startswith(("//", "#")):
            out.append((n, s))
    return out


def include_problems(path: Path) -> list[str]:
    """What breaks the rule in one C file: any project include in a header; in a .c file, a
    project include after its first line of code."""
    text = path.read_text()
    rel = path.name
    if path.suffix == ".h":
        return [f"{rel}:{text[:m.start()].count(chr(10)) + 1} includes {m.group(1)} (a header includes no project "
                f"header: list it in the .c file's include block)" for m in _PROJECT_INCLUDE.finditer(text)]
    code = _code_lines(text)
    first = code[0][0] if code else 10**9
    return [f"{rel}:{text[:m.start()].count(chr(10)) + 1} includes {m.group(1)} after its first line of code "
            f"(line {first})" for m in _PROJECT_INCLUDE.finditer(text) if text[:m.start()].count("\n") + 1 > first]


def test_consumers_c_headers_are_included_once_at_the_top_of_the_c_file():
    problems = [p for path in sorted(CONSUMERS.glob("*.[ch]")) for p in include_problems(path)]
    assert problems == []
    headers = sorted(p.name for p in CONSUMERS.glob("*.h"))
    included = _PROJECT_INCLUDE.findall((CONSUMERS / "_fastpath.c").read_text())
    assert sorted(included) == headers, "every header of consumers/ is included once, by _fastpath.c"


def test_the_include_check_finds_a_chained_header(tmp_path):
    h = tmp_path / "a.h"
    h.write_text('/* a.h */\n#include "b.h"\nstatic int a;\n#include "c.h"\n')
    c = tmp_path / "m.c"
    c.write_text('/* m.c\n * #include "x.h" in a comment */\n#define X 1\n#include <stdio.h>\n#include "a.h"\n'
                 'static int m;\n#include "late.h"\n')
    assert [p.split(" includes ")[0] + " " + p.split()[2] for p in include_problems(h)] == ["a.h:2 b.h", "a.h:4 c.h"]
    assert include_problems(c) == ['m.c:7 includes late.h after its first line of code (line 6)']


_C_NAMES = {"_FAST", "accel", "_accel"}  # the C module and the native table's access


def _is_none_test(test: ast.expr) -> bool:
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None)


def scorer_path_choices(source: str) -> list[str]:
    """Path choices in the scorer beyond "is the C table there": getattr/hasattr on the C
    module, and any condition on the C module or the table's access other than one
    ``is None`` / ``is not None`` test (a size, a capability probe...)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "_FAST":
            out.append(f"line {node.lineno}: {node.func.id}(_FAST, ...)")
        if isinstance(node, (ast.If, ast.IfExp)) and any(
                (isinstance(x, ast.Name) and x.id in _C_NAMES) or (isinstance(x, ast.Attribute) and x.attr in _C_NAMES)
                for x in ast.walk(node.test)) and not _is_none_test(node.test):
            out.append(f"line {node.lineno}: a path condition beyond 'is the C table there'")
    return sorted(out, key=lambda s: int(s.split()[1].rstrip(":")))


def test_the_scorer_has_one_c_path_and_its_reference():
    assert scorer_path_choices((CONSUMERS / "scorer.py").read_text()) == []


def test_the_scorer_check_finds_twin_probes():
    src = ('_walk = getattr(_FAST, "score_walk", None)\n'
           'def f(accel, lanes):\n'
           '    if accel is None or len(lanes) > 16 or accel.cap > 1024:\n'
           '        return None\n'
           '    return hasattr(_FAST, "score_json")\n')
    assert scorer_path_choices(src) == ["line 1: getattr(_FAST, ...)",
                                        "line 3: a path condition beyond 'is the C table there'",
                                        "line 5: hasattr(_FAST, ...)"]
