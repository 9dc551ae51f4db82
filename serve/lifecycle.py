"""Process life cycle under a supervisor: SIGTERM drains instead of closing the listener.

Kubernetes and compose stop a container with SIGTERM, then SIGKILL after a grace period.
uvicorn alone closes its listener at once (new connections: *refused*, not 503) and re-raises
the signal (exit 143). :class:`DrainingServer` instead, on the first SIGTERM: keeps listening
while :meth:`serve.app.Gateway.drain` runs (``/ready`` 503, ``/health`` 200, new and queued
requests 503 + ``Retry-After``, running requests get ``drain_timeout_s`` to finish, then are
cut with one error event or a 503), then stops uvicorn and exits 0. SIGINT (Ctrl-C) and a
second signal stop at once, as uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

log = logging.getLogger("serve.lifecycle")


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose SIGTERM drains the gateway first (module docstring).

    Args:
        config: uvicorn's configuration.
        drain: coroutine function run on SIGTERM before uvicorn stops (``Gateway.drain``).
        ssl_refresh: reload the TLS key and certificates when their files change (vLLM's
            ``--enable-ssl-refresh``, with vLLM's own ``SSLCertRefresher``).
    """

    def __init__(self, config: uvicorn.Config, drain, ssl_refresh: bool = False) -> None:
        super().__init__(config)
        self._drain = drain
        self._ssl_refresh = ssl_refresh
        self._ssl_refresher = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Future | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self._ssl_refresh and self.config.ssl is not None:
            from vllm.entrypoints.launchers.utils.ssl import SSLCertRefresher

            self._ssl_refresher = SSLCertRefresher(
                ssl_context=self.config.ssl, key_path=self.config.ssl_keyfile,
                cert_path=self.config.ssl_certfile, ca_path=self.config.ssl_ca_certs)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        if self._draining is None:  # the first SIGTERM: drain (a second one is ignored)
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            try:
                await self._drain()
            except Exception:  # noqa: BLE001 - stop anyway: the supervisor is waiting
                log.exception("drain failed")
            self.should_exit = True

        self._draining = asyncio.ensure_future(drain_then_exit())
