"""Instruction counts of code regions under ``valgrind --tool=callgrind`` (deterministic costs).

A child process runs under callgrind; :class:`Region` marks the measured part with callgrind
client requests (``CALLGRIND_ZERO_STATS`` before, ``CALLGRIND_DUMP_STATS_AT(label)`` after),
so each region becomes one dump file whose ``summary:`` line is the instructions executed by
ALL threads of the process between the two marks (ZeroMQ's I/O threads, a publisher's
sender thread...). The client requests come from a tiny C helper compiled once with the
system compiler against ``<valgrind/callgrind.h>``; outside valgrind they are no-ops.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["CallgrindUnavailable", "Region", "check_tools", "new_out_dir", "pick_cases", "read_dumps", "require_tools",
           "run_child"]

_C_SRC = r"""
#include <valgrind/callgrind.h>
void kv_cg_zero(void) { CALLGRIND_ZERO_STATS; }
void kv_cg_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
void kv_cg_instr_on(void) { CALLGRIND_START_INSTRUMENTATION; }
"""


class CallgrindUnavailable(RuntimeError):
    """valgrind, a C compiler or valgrind's headers are missing."""


def check_tools() -> None:
    if shutil.which("valgrind") is None:
        raise CallgrindUnavailable("valgrind is not on PATH (apt-get install valgrind)")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        raise CallgrindUnavailable("no C compiler (cc/gcc) to build the callgrind client-request helper")
    if not os.path.exists("/usr/include/valgrind/callgrind.h"):
        raise CallgrindUnavailable("/usr/include/valgrind/callgrind.h missing (valgrind's development headers)")


def require_tools() -> None:
    """Exit with status 2 and the reason where callgrind cannot run here."""
    try:
        check_tools()
    except CallgrindUnavailable as exc:
        print(f"callgrind unavailable: {exc}", file=sys.stderr)
        sys.exit(2)


def pick_cases(ap: Any, spec: str, known: Any) -> list[str]:
    """The comma-separated cases of ``spec``; an unknown one is the parser's error."""
    cases = [c.strip() for c in spec.split(",") if c.strip()]
    for c in cases:
        if c not in known:
            ap.error(f"unknown case {c!r}; choose from {', '.join(known)}")
    return cases


def _build_helper(dirname: str) -> str:
    src = os.path.join(dirname, "kv_cg.c")
    lib = os.path.join(dirname, "kv_cg.so")
    with open(src, "w") as f:
        f.write(_C_SRC)
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    return lib


class Region:
    """Start/stop marks of measured regions, for use inside the child process."""

    def __init__(self, lib_path: str) -> None:
        self._lib = ctypes.CDLL(lib_path)
        self._lib.kv_cg_dump.argtypes = [ctypes.c_char_p]
        self.label = "region"
        self.last = None  # whatever the caller passed to stop()

    def start(self) -> None:
        # CALLGRIND_ZERO_STATS zeroes the calling thread only; a dump zeroes every thread, so
        # dump (and ignore) whatever all threads did since the last mark, then zero
        self._lib.kv_cg_dump(b"-discard-")
        self._lib.kv_cg_zero()

    def stop(self, ctx=None) -> None:
        self._lib.kv_cg_dump(self.label.encode())
        self.last = ctx

    def instrument(self) -> None:
        """Start instrumenting (for a child run with ``--instr-atstart=no``: imports and set-up
        then run at plain valgrind speed, several times faster than under instrumentation)."""
        self._lib.kv_cg_instr_on()


def run_child(argv: list[str], out_dir: str, env: dict, timeout: float) -> tuple[int, str]:
    """Run ``argv`` (a Python command line) under callgrind, dumps under ``out_dir``.

    The child finds the helper library in ``KV_CALLGRIND_LIB``. Returns (exit code, stderr tail);
    exit code None on timeout."""
    lib = _build_helper(out_dir) if not os.path.exists(os.path.join(out_dir, "kv_cg.so")) else \
        os.path.join(out_dir, "kv_cg.so")
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir}/cg.out",
           "--dump-instr=no", "--dump-line=no"] + argv
    env = dict(env, KV_CALLGRIND_LIB=lib)
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                           text=True)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    return p.returncode, (p.stdout + p.stderr)[-2000:]


_DESC = re.compile(r"^desc: Trigger: Client Request: (.*)$", re.M)
_SUMMARY = re.compile(r"^summary: (\d+)", re.M)  # "totals:" may omit cost outside the listed lines


def read_dumps(out_dir: str) -> dict[str, int]:
    """label -> instructions (Ir) of each region dumped in ``out_dir``."""
    res: dict[str, int] = {}
    for path in glob.glob(os.path.join(out_dir, "cg.out.*")):
        with open(path) as f:
            text = f.read()
        d, t = _DESC.search(text), _SUMMARY.search(text)
        if d and t and d.group(1).strip() != "-discard-":
            res[d.group(1).strip()] = int(t.group(1))
    return res


def new_out_dir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix)
