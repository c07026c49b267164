"""Loads the optional C helper of the replay server (:mod:`._zmqio`), bound to pyzmq's libzmq.

``NATIVE`` is the bound module, or None where it was not built or cannot find the libzmq this
process loaded (then the replay server does the same work in Python); ``STATUS`` says which and
why. ``KVEVENTS_ZMQIO=0`` in the environment turns it off (A/B measurements, tests of the fallback).
"""

from __future__ import annotations

import os

import zmq

__all__ = ["NATIVE", "STATUS", "libzmq_path"]


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


def _load():
    if os.environ.get("KVEVENTS_ZMQIO", "1") == "0":
        return None, "off (KVEVENTS_ZMQIO=0)"
    try:
        from . import _zmqio
    except ImportError as exc:
        return None, f"not built ({exc})"
    path = libzmq_path()
    if path is None:
        return None, "libzmq not found among this process's mapped files"
    try:
        version = _zmqio.bind(path)
    except OSError as exc:
        return None, f"cannot bind to libzmq: {exc}"
    return _zmqio, f"native (libzmq {'.'.join(map(str, version))} from {path})"


NATIVE, STATUS = _load()
