"""Loads the optional C helper of the replay server (:mod:`._zmqio`), bound to pyzmq's libzmq.

``NATIVE`` is the bound module, or None where it was not built or cannot find the libzmq this
process loaded (then the replay server does the same work in Python); ``STATUS`` says which and
why. ``KVEVENTS_ZMQIO=0`` in the environment turns it off (A/B measurements, tests of the fallback).
"""

from __future__ import annotations

import importlib
import os

import zmq  # noqa: F401  (loads libzmq: libzmq_path() finds it among the mapped files)

__all__ = ["NATIVE", "STATUS", "libzmq_path", "load_bound"]


def libzmq_path() -> str | None:
    """The file this process's libzmq was loaded from (pyzmq's bundled copy or the system's)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").partition("/")[2]
                if path and os.path.basename(path).startswith("libzmq"):
                    return "/" + path
    except OSError:
        return None
    return None


def load_bound(module: str, env: str) -> tuple[object | None, str]:
    """Import the optional C helper ``module`` (a sibling of this file) and bind it to this
    process's libzmq: (the module, a status line), or (None, why not). ``env``=0 in the
    environment turns it off (A/B measurements, tests of the fallback)."""
    if os.environ.get(env, "1") == "0":
        return None, f"off ({env}=0)"
    try:
        mod = importlib.import_module(f"{__package__}.{module}")
    except ImportError as exc:
        return None, f"not built ({exc})"
    path = libzmq_path()
    if path is None:
        return None, "libzmq not found among this process's mapped files"
    try:
        version = mod.bind(path)
    except OSError as exc:
        return None, f"cannot bind to libzmq: {exc}"
    return mod, f"native (libzmq {'.'.join(map(str, version))} from {path})"


NATIVE, STATUS = load_bound("_zmqio", "KVEVENTS_ZMQIO")
