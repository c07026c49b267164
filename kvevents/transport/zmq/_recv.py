"""The live path's socket reads and sends run in Python, through pyzmq's public API.

``NATIVE`` is None: there is no C helper for the live path (a C drain bound to libzmq needs
libzmq's headers and the very libzmq pyzmq loaded, which pyzmq's wheels do not offer to other
extensions; ``benchmarks/NOTES.md`` has the measurements). It stays importable, with ``STATUS``,
for the subscriber's drain, which checks it.
"""

from __future__ import annotations

__all__ = ["NATIVE", "STATUS"]

NATIVE = None
STATUS = "python (pyzmq's recv and send)"
