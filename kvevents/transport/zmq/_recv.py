"""Loads the optional C helper of the live path (:mod:`._zmqrecv`: a subscriber socket's drain,
a publisher's group of sends, each in one call), bound to pyzmq's libzmq.

``NATIVE`` is the bound module, or None where it was not built or cannot find the libzmq this
process loaded (then the subscriber reads frame by frame and the publisher sends frame by frame
in Python: the same messages); ``STATUS``
says which and why. ``KVEVENTS_ZMQRECV=0`` in the environment turns it off (A/B measurements,
tests of the fallback).
"""

from __future__ import annotations

import os

from ._native import libzmq_path

__all__ = ["NATIVE", "STATUS"]


def _load():
    if os.environ.get("KVEVENTS_ZMQRECV", "1") == "0":
        return None, "off (KVEVENTS_ZMQRECV=0)"
    try:
        from . import _zmqrecv
    except ImportError as exc:
        return None, f"not built ({exc})"
    path = libzmq_path()
    if path is None:
        return None, "libzmq not found among this process's mapped files"
    try:
        version = _zmqrecv.bind(path)
    except OSError as exc:
        return None, f"cannot bind to libzmq: {exc}"
    return _zmqrecv, f"native (libzmq {'.'.join(map(str, version))} from {path})"


NATIVE, STATUS = _load()
