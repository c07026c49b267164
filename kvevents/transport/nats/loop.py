"""nats-py is asyncio; our publishers and sources are called from plain threads. A
:class:`LoopThread` runs one event loop on a dedicated daemon thread and runs coroutines on it
from any other thread. Public: the plane's sender and source use it, and so does the service's
replica (``kvservice/replica.py``), which talks to the same JetStream from its own thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from ...errors import ConfigError, EndpointError


def need_nats():
    """The ``nats`` client module, or a ConfigError saying how to install it."""
    try:
        import nats
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(f"the NATS event plane needs nats-py: pip install 'kvevents[nats]' ({exc})") from None
    return nats


def server_url(url: str) -> str:
    """``nats://HOST:PORT`` checked (``tls://`` too); an EndpointError names a bad one."""
    if not isinstance(url, str) or not url.startswith(("nats://", "tls://")):
        raise EndpointError(f"event-plane URL must be nats://HOST:PORT (or tls://), got {url!r}")
    rest = url.split("://", 1)[1].rsplit("@", 1)[-1]
    host, _, port = rest.rstrip("/").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"event-plane URL {url!r} needs a host and a port 1-65535")
    return url


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine, timeout: float | None = 30.0) -> Any:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, coro: Coroutine) -> Any:
        """Run a component's start-up ``coro`` like :meth:`call`; if it fails, stop the loop (the
        component never started, so nothing else will) and raise its error."""
        try:
            return self.call(coro)
        except BaseException:
            self.stop()
            raise

    def submit(self, coro: Coroutine):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close_connection(self, nc, before=None) -> None:
        """Close NATS connection ``nc`` on the loop (after ``before()``, run there; errors of a
        connection already gone are ignored: this is shutdown), then stop the loop."""
        async def _close() -> None:
            if before is not None:
                before()
            try:
                await asyncio.wait_for(nc.close(), 2)
            except Exception:
                pass
        try:
            self.call(_close(), 5)
        except Exception:
            pass
        self.stop()

    def stop(self) -> None:
        """Cancel what still runs on the loop (let it see the cancellation), then stop the loop."""
        async def _cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_rest(), self.loop).result(5)
            except Exception:
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


async def connect(url: str, name: str, **kw):
    """A NATS connection that retries for ever (a restarted server is found again) and reports
    disconnects through ``kw['on_event']`` if given."""
    nats = need_nats()
    on_event = kw.pop("on_event", None)

    async def disconnected():
        if on_event:
            on_event("disconnects")

    async def reconnected():
        if on_event:
            on_event("reconnects")

    async def error(exc):
        if on_event:
            on_event("errors")

    return await nats.connect(server_url(url), name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                              disconnected_cb=disconnected, reconnected_cb=reconnected, error_cb=error,
                              connect_timeout=2, allow_reconnect=True, **kw)
