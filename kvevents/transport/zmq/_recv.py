"""Loads the optional C helper of the live path (:mod:`._zmqrecv`: a subscriber socket's drain
in one call), bound to pyzmq's libzmq.

``NATIVE`` is the bound module, or None where it was not built or cannot find the libzmq this
process loaded (then the subscriber reads frame by frame in Python: the same messages); ``STATUS``
says which and why. ``KVEVENTS_ZMQRECV=0`` in the environment turns it off (A/B measurements,
tests of the fallback).
"""

from __future__ import annotations

from ._native import load_bound

__all__ = ["NATIVE", "STATUS"]

NATIVE, STATUS = load_bound("_zmqrecv", "KVEVENTS_ZMQRECV")
