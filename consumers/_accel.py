"""Loading the router's optional C fast path (``consumers/_fastpath.c``).

``pip install`` builds it where a C compiler is present; without one the build skips it and
the router runs in pure Python, with the same answers (only slower). Set
``KVEVENTS_PURE_PYTHON=1`` to ignore a built extension.

The extension recomputes CPython's int and tuple hashes (the router's keys are defined by
them, see :mod:`consumers.keys`), so before it is used it must give the very keys the
Python chain gives, both from a Python list (``chain_keys``) and from a msgpack payload
(``apply``). If it ever does not (a future CPython changing its hashes), it is not used and
:func:`status` says why. This module imports nothing of the router (the chain to compare
with is passed in): ``keys`` -> ``_accel`` is one way.
"""

from __future__ import annotations

import os
from array import array
from pathlib import Path
from types import ModuleType
from typing import Callable

__all__ = ["load", "module", "status"]

_STATE: dict[str, object] = {"module": None, "reason": "not loaded yet"}

# token ids chosen to exercise every int hash case: small, >= 2**61 - 1 (reduced), negative,
# -1 (hashes to -2), and the msgpack int widths
_PROBE = [0, 1, 127, 128, 255, 65_535, 65_536, 150_000, 2**31, 2**32 + 5, 2**61 - 1, 2**61, 2**63 + 7,
          2**64 - 1, -1, -2, -33, -129, -40_000, -(2**31), -(2**63), 2**60 - 1, 42, 7]


def _self_check(mod: ModuleType, chain_py: Callable) -> str | None:
    """None if the extension agrees with the pure-Python chain, else what disagreed."""
    from kvevents import BlockStored, KVEventBatch, encode_batch

    for bs in (1, 3, 8):
        for parent in (0, 12_345, 2**60 - 1):
            if mod.chain_keys(_PROBE, parent, bs) != chain_py(_PROBE, parent, bs):
                return f"chain_keys differs from the Python chain (block size {bs}, parent {parent})"
    bs = 8
    n = len(_PROBE) // bs
    hashes = list(range(1000, 1000 + n))
    payload = encode_batch(KVEventBatch(0.0, [BlockStored(hashes, None, _PROBE[: n * bs], bs, None, "GPU", None)], 0))
    lmap = mod.LearnedTable()
    table = mod.MaskTable(bits=64)
    tally = array("q", [0] * mod.TALLY_SLOTS)
    tally[8] = 1 << 30  # learned room
    ctx = (0, lmap, table, 99, bs, [False], 0, 0, ("GPU",), (0,), (2,), (False,), 1 << 30, 1 << 29)
    out = mod.apply(payload, {0: ctx}, 0, tally)
    keys = chain_py(_PROBE[: n * bs], 99, bs)
    if out is None or out[0] != 0 or [lmap.get(h) for h in hashes] != keys:
        return "apply's key hashing differs from the Python chain"
    if table.items() != [(k, 1) for k in keys]:
        return "the mask table does not hold what apply stored"
    if list(tally[:3]) != [1, 1, n] or tally[7] != n:
        return "apply's counts are off"
    return None


def _why_missing(here: "Path | None" = None) -> str:
    """Why the package imported has no ``_fastpath`` next to it: never built, or a source checkout
    imported instead of the installed package (running from inside the checkout)."""
    import importlib.machinery
    import sys

    here = here or Path(__file__).resolve().parent
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    for entry in sys.path:
        pkg = Path(entry or ".").resolve() / here.name
        if pkg != here and any((pkg / f"_fastpath{sfx}").is_file() for sfx in suffixes):
            return (f"not loaded: this process imports {here.name} from {here} (the current directory or "
                    f"PYTHONPATH shadows the installed package at {pkg}, which has the C fast path built); "
                    "run from outside the source checkout, or build it in place with `pip install -e .`; pure Python")
    if (here / "_fastpath.c").is_file() and (here.parent / "setup.py").is_file():
        return (f"not built in the source checkout at {here.parent} (import from an installed package, or build "
                "it in place with `pip install -e .`; without a C compiler the build skips it); pure Python")
    return "not built (no C compiler when the package was installed); pure Python"


def load(chain_py: Callable) -> ModuleType | None:
    """The extension module if it is built, wanted and agrees with ``chain_py``; else None."""
    if os.environ.get("KVEVENTS_PURE_PYTHON", "") not in ("", "0"):
        _STATE.update(module=None, reason="disabled by KVEVENTS_PURE_PYTHON")
        return None
    try:
        from . import _fastpath  # type: ignore[attr-defined]
    except ImportError as exc:
        import importlib.util

        if importlib.util.find_spec(f"{__package__}._fastpath") is None:
            reason = _why_missing()
        else:
            reason = f"cannot be loaded ({exc}); pure Python"
        _STATE.update(module=None, reason=reason)
        return None
    try:
        problem = _self_check(_fastpath, chain_py)
    except Exception as exc:  # a broken build must not take the router down
        problem = f"self-check raised {type(exc).__name__}: {exc}"
    if problem is not None:
        _STATE.update(module=None, reason=f"self-check failed: {problem}; pure Python")
        return None
    _STATE.update(module=_fastpath, reason="C fast path (consumers._fastpath)")
    return _fastpath


def module() -> ModuleType | None:
    """The loaded extension (None: pure Python or not loaded yet; :mod:`consumers.keys` loads it
    on import)."""
    return _STATE["module"]  # type: ignore[return-value]


def status() -> str:
    """Which ingest/hash path this process runs, and why."""
    return str(_STATE["reason"])
