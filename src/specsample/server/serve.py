"""`specsample serve`'s HTTP server: uvicorn, with a shutdown that drains in time.

The first SIGINT or SIGTERM starts the drain: new requests get 503 and requests in flight have
`--shutdown-timeout` seconds to finish; then the ones still running are ended (a stream with an error event and
`[DONE]`, any other response with 503) and the server exits with status 0. A second signal ends them at once.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from specsample.server.app import build_app
from specsample.server.state import SpecServer

log = logging.getLogger("specsample.server")

FLUSH_SECONDS = 2.0  # for ended requests to send their last bytes before the server closes


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the signals handled as the module says (uvicorn's own handling waits for every
    request without a limit, and a second Ctrl-C cuts the connections mid-response)."""

    def __init__(self, config: uvicorn.Config, spec: SpecServer) -> None:
        super().__init__(config)
        self.spec = spec
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._signals = 0
        self._hurry = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.spec.grammar_pool is not None:  # the first structured request then waits for no process start
            warming = self._loop.create_task(self.spec.grammar_pool.warm())
        await super().serve(sockets)
        if self.spec.grammar_pool is not None:
            warming.cancel()

    def handle_exit(self, sig: int, frame) -> None:
        # not recorded as uvicorn records signals: it would raise the signal again once shut down (exit status != 0)
        self._signals += 1
        if self._loop is None:
            self.should_exit = True
        elif self._signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self._hurry = True

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        spec, loop = self.spec, asyncio.get_running_loop()
        spec.draining = True
        limit = spec.options.shutdown_timeout
        if spec.active:
            log.warning(
                "shutting down: %d request(s) in flight have %g s to finish (Ctrl-C again: end them now)",
                spec.active,
                limit,
            )
        deadline = loop.time() + limit
        while spec.active and not self._hurry and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if spec.active:
            log.warning("shutting down: ending %d request(s) still running", spec.active)
        spec.end_all()
        deadline = loop.time() + FLUSH_SECONDS
        while spec.active and loop.time() < deadline:
            await asyncio.sleep(0.01)
        self.should_exit = True


def serve_http(spec: SpecServer, host: str, port: int) -> None:
    """Serve `spec` on host:port until a signal (see the module)."""
    config = uvicorn.Config(
        build_app(spec), host=host, port=port, log_level="warning", timeout_graceful_shutdown=FLUSH_SECONDS
    )
    DrainingServer(config, spec).run()
