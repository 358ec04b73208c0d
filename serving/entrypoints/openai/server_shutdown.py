"""Stopping the server without cutting a stream.

The first SIGINT or SIGTERM stops taking requests: a new one gets a 503 that says why (`DrainGuard`), on a
new connection or a kept-alive one, and /health turns 503 so that a load balancer looks elsewhere. The
requests in flight get `--shutdown-timeout` seconds to finish. Those still running then are aborted:
each stream ends with a chunk whose finish_reason is "abort", then `[DONE]`; a non-streaming request
answers with what it has, finish_reason "abort". Then the server exits and the engine stops. A second
signal aborts at once; a third leaves without waiting for the aborted streams' last chunks.

uvicorn's own graceful shutdown cannot do this: it closes the listening socket (new requests are refused,
not told), and when its timeout runs out it cancels the handlers, which then cannot write a last chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import uvicorn

from .server_errors import error_response
from .server_middleware import HttpMiddleware

logger = logging.getLogger("tp_overlap.server")

# How long the aborted requests may take to send their last chunk before the server leaves anyway.
ABORT_GRACE_S = 5.0


class InFlight:
    """The requests in flight: what a shutdown waits for, and how it aborts them."""

    def __init__(self):
        self.requests = 0            # HTTP requests to the work routes, until their response is sent
        self.draining = False        # no new requests
        self.aborting = False        # the requests in flight are being aborted
        self._aborts: set[Callable[[], None]] = set()

    def register(self, abort: Callable[[], None]) -> Callable[[], None]:
        """`abort` ends one request's engine requests now (`OpenAIServing._run`); the returned function
        unregisters it. A request that registers while aborting is aborted at once."""
        self._aborts.add(abort)
        if self.aborting:
            abort()
        return lambda: self._aborts.discard(abort)

    def abort_all(self) -> None:
        self.aborting = True
        for abort in list(self._aborts):
            abort()

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every request finished within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.requests


class DrainGuard(HttpMiddleware):
    """ASGI middleware: counts the requests in flight on the work routes; while the server drains, new
    ones get a 503 (the connection then closes) and /health says the server is stopping."""

    WORK = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app, in_flight: InFlight):
        super().__init__(app)
        self.in_flight = in_flight

    async def handle(self, scope, receive, send):
        path = scope["path"]
        if self.in_flight.draining and (path.startswith(self.WORK) or path == "/health"):
            resp = error_response(503, "the server is shutting down and takes no new requests; send it to another "
                                       "server or retry once this one is back", code="server_shutting_down")
            resp.headers["Connection"] = "close"
            await resp(scope, receive, send)
            return
        if not path.startswith(self.WORK):
            await self.app(scope, receive, send)
            return
        self.in_flight.requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.requests -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the shutdown of this module's docstring: `grace_s` is --shutdown-timeout."""

    def __init__(self, config: uvicorn.Config, in_flight: InFlight, grace_s: float):
        super().__init__(config)
        self.in_flight = in_flight
        self.grace_s = grace_s
        self.signals = 0
        self._loop = None
        self._drain = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and self.servers and self.servers[0].sockets:
            # (uvicorn says where it listens only for a socket it bound itself)
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            logger.info("serving on http://%s:%d; Ctrl-C stops taking requests and lets those in flight finish "
                        "(a second Ctrl-C aborts them)", f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler (the main thread, between two bytecodes of the event loop): it only schedules.
        self.signals += 1
        if self._loop is None:          # not serving yet
            super().handle_exit(sig, frame)
            return
        if self.signals == 1:
            self._loop.call_soon_threadsafe(self._start_drain, sig)
        elif self.signals == 2:
            self._loop.call_soon_threadsafe(self._abort, "a second signal")
        else:
            self.should_exit = self.force_exit = True

    def _start_drain(self, sig: int) -> None:
        self.in_flight.draining = True
        logger.info("signal %d: taking no new requests; %d in flight get %.0f s to finish (a second signal "
                    "aborts them now)", sig, self.in_flight.requests, self.grace_s)
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    def _abort(self, why: str) -> None:
        if not self.in_flight.aborting and self.in_flight.requests:
            n = self.in_flight.requests
            logger.warning("%s: aborting the %d request%s in flight", why, n, "" if n == 1 else "s")
        self.in_flight.abort_all()

    async def _drain_then_exit(self) -> None:
        try:
            if not await self.in_flight.wait_idle(self.grace_s):
                self._abort(f"--shutdown-timeout ({self.grace_s:g} s) is over")
            if not await self.in_flight.wait_idle(ABORT_GRACE_S):
                logger.error("%d aborted requests did not end within %.0f s; leaving without them",
                             self.in_flight.requests, ABORT_GRACE_S)
        finally:
            self.should_exit = True
