"""Running nats-server ourselves (the plane demo, ``benchmarks/fleet.py``): where the binary is,
and the environment we start it with, which is also what the README recommends for a
deployment's brokers.

``GODEBUG=madvdontneed=0``: Go's runtime then hands freed heap back to the kernel with
``MADV_FREE`` (the kernel takes the pages only when it needs them) instead of ``MADV_DONTNEED``
(taken at once, so the next use faults each page in again, zeroed). With file storage the
server's per-block write caches grow and are freed all the time; measured with
``benchmarks/fleet.py`` on the 2-core development VM (README "Past one machine"), a plain
server took 30-45 page faults per 1,000 events and 0.8-1.4 µs of CPU per event, and the
plane's 16-event-batch rate moved between 487k and 600k events/s across runs; with the setting,
2-12 faults and 0.8 µs. A server's resident memory then stays nearer its peak (the kernel
reclaims it under pressure); an operator who wants the other trade sets ``madvdontneed=1``
in ``GODEBUG`` themselves, which :func:`broker_env` leaves as it is.

Who may publish where: a server we start for the plane (the demo, the tests) gets users with
per-subject permissions, :func:`~kvevents.transport.nats.permissions.auth_config` (the block a
deployment copies: docs/event-plane-security.md).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from .permissions import auth_config

__all__ = ["RECOMMENDED_GODEBUG", "auth_config", "broker_env", "find_nats_server"]

RECOMMENDED_GODEBUG = "madvdontneed=0"


def broker_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with ``madvdontneed=0`` added to
    ``GODEBUG``, unless ``GODEBUG`` already says ``madvdontneed`` (the operator's choice)."""
    out = dict(os.environ if env is None else env)
    settings = [s for s in out.get("GODEBUG", "").split(",") if s.strip()]
    if not any(s.strip().startswith("madvdontneed=") for s in settings):
        settings.append(RECOMMENDED_GODEBUG)
    out["GODEBUG"] = ",".join(settings)
    return out


def find_nats_server() -> str | None:
    """``$KVEVENTS_NATS_SERVER`` if set (it must be executable), else nats-server on PATH, else
    Debian's ``/usr/sbin/nats-server``; None where there is none."""
    forced = os.environ.get("KVEVENTS_NATS_SERVER")
    if forced:
        return forced if os.access(forced, os.X_OK) else None
    return shutil.which("nats-server") or ("/usr/sbin/nats-server" if os.path.exists("/usr/sbin/nats-server") else None)
