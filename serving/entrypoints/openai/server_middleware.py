"""ASGI middlewares of the server, outermost first: `ResponseCounter` (responses by route and status for
/metrics), `ErrorBarrier` (an exception no handler answered becomes OpenAI's 500, or an error event in a
stream), `DrainGuard` (503 while the server shuts down), `ApiKeyGuard` (the bearer token), `BodyCheck`
(a body over the size limit is a 413; a JSON body that is not UTF-8 or nests too deep is named before the
JSON parser gives up on it)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re

from typing import Optional

from fastapi.responses import JSONResponse

from ...metrics import ServerMetrics
from .protocol import sse
from .server_config import DEFAULT_MAX_BODY_BYTES
from .server_errors import error_response, internal_error_body, is_json_media_type

logger = logging.getLogger("tp_overlap.server")


class HttpMiddleware:
    """An ASGI middleware of HTTP requests: every other scope (lifespan, websocket) passes through
    untouched; `handle` sees the HTTP ones."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        await self.app(scope, receive, send)


class ErrorBarrier(HttpMiddleware):
    """ASGI middleware: an exception no handler turned into a response ends here, as a JSON 500 in OpenAI's
    shape, or, once a stream has started, as an error event that closes the stream.

    Starlette re-raises an exception after its handler has sent the 500, and uvicorn then drops the
    connection without `Connection: close`, so a keep-alive client's next request fails with a reset. This
    middleware keeps the exception from reaching uvicorn, and the connection stays usable."""

    async def handle(self, scope, receive, send):
        state = {"started": False, "done": False, "sse": False}

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                state["sse"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if state["done"]:
                return      # the exception handler answered (and logged) already
            logger.error("unhandled error on %s", scope.get("path"), exc_info=exc)
            body = internal_error_body(exc)
            with contextlib.suppress(Exception):   # the client may be gone
                if not state["started"]:
                    await JSONResponse(body, status_code=500)(scope, receive, send)
                elif state["sse"]:
                    await send({"type": "http.response.body", "body": (sse(body) + sse("[DONE]")).encode(),
                                "more_body": False})
                else:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


# Deeper than any request this API defines (a JSON schema in response_format included); far below the
# recursion limit at which Python's JSON parser fails with a bare "error parsing the body".
MAX_JSON_DEPTH = 100
# Strings (whose brackets are text) and everything that is no bracket, dropped before depth is counted.
_JSON_STRING = re.compile(r'"(?:[^"\\]+|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_body_problem(body: bytes) -> Optional[str]:
    """What makes `body` unreadable before JSON parsing proper: not UTF-8 (where), or nested deeper than
    MAX_JSON_DEPTH. None when neither (the parser still judges the rest)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return (f"the request body is not valid UTF-8 at byte {e.start} (0x{body[e.start]:02x}: {e.reason}); "
                f"send JSON encoded as UTF-8")
    depth = 0
    for ch in _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)):
        depth += 1 if ch in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            return f"JSON nesting deeper than {MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH) in the request body"
    return None


class BodyCheck(HttpMiddleware):
    """ASGI middleware: a POST body is read whole (as FastAPI would), but never more than `max_bytes` of it:
    a body that its Content-Length or its bytes so far put over the limit is a 413 at once, none of it goes
    further, and the connection closes once at most DRAIN_BYTES more have been dropped (_drain says why). A
    JSON body is then checked
    by json_body_problem; a problem is a 400 that says what and where, else the body is handed on."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope, receive, send):
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send, f"{int(declared)} bytes", more=True)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":   # the client left: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:   # (a chunked body, or one longer than it said)
                await self._too_large(scope, receive, send, f"more than {self.max_bytes} bytes",
                                      more=message.get("more_body", False))
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if is_json_media_type(headers.get(b"content-type", b"").decode("latin-1")):
            problem = json_body_problem(body)
            if problem is not None:
                await error_response(400, problem)(scope, receive, send)
                return
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)

    async def _too_large(self, scope, receive, send, size: str, more: bool) -> None:
        logger.warning("%s: a request body of %s refused (the limit is %d bytes, --max-request-body-bytes)",
                       scope.get("path"), size, self.max_bytes)
        resp = error_response(413, f"the request body ({size}) is larger than this server's limit of "
                                   f"{self.max_bytes} bytes (the server's --max-request-body-bytes)",
                              code="request_too_large")
        resp.headers["Connection"] = "close"   # this connection is done: what is left of the body is dropped
        await resp(scope, receive, send)
        if more:
            await _drain(receive)


# After a 413 the rest of the body is read and dropped, up to this much and for up to DRAIN_S, before the
# connection closes: closed with a body still arriving, the socket resets, and a client still sending a
# body a little over the limit would see "connection reset" instead of the 413 (CI on two cores did). A
# larger body, or a slower one, is cut off.
DRAIN_BYTES = 1 << 20
DRAIN_S = 2.0


async def _drain(receive) -> None:
    async def drop():
        left = DRAIN_BYTES
        while left > 0:
            message = await receive()
            if message["type"] != "http.request":
                return
            left -= len(message.get("body", b""))
            if not message.get("more_body", False):
                return
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(drop(), DRAIN_S)


def _replay(messages: list, receive):
    pending = list(messages)

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()   # (after the body: a disconnect)

    return replayed


class ApiKeyGuard(HttpMiddleware):
    """ASGI middleware: /v1/*, /tokenize and /detokenize need `Authorization: Bearer <key>`. Checked before
    the body is parsed, so an unauthenticated client learns nothing about its request. /health, /metrics
    and /version stay open."""

    GUARDED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app, key: str):
        super().__init__(app)
        self.expected = f"Bearer {key}".encode()

    async def handle(self, scope, receive, send):
        if scope["path"].startswith(self.GUARDED):
            auth = b""
            for k, v in scope.get("headers", []):
                if k == b"authorization":
                    auth = v
            if not hmac.compare_digest(auth, self.expected):
                msg = "missing API key" if not auth else "invalid API key"
                resp = error_response(401, f"{msg}: send 'Authorization: Bearer <key>'", code="invalid_api_key")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ResponseCounter(HttpMiddleware):
    """ASGI middleware counting responses by route and status for /metrics."""

    _ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
               "/health", "/metrics", "/version"}

    def __init__(self, app, metrics: ServerMetrics):
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope, receive, send):
        path = scope["path"]
        route = path if path in self._ROUTES else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_responses.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)

    def __getattr__(self, name):
        return getattr(self.app, name)
