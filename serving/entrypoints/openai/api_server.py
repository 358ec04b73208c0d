"""OpenAI-compatible HTTP server over `AsyncLLM`: `tp-overlap serve`.

    tp-overlap serve                                   # the built-in demo model on 127.0.0.1:8000
    tp-overlap serve --model /models/Llama-3.1-8B --tp 2 --api-key secret

Routes: POST /v1/completions (serving_completion.py), POST /v1/chat/completions (serving_chat.py), both
streaming as SSE with `stream: true`; POST /v1/responses, GET and DELETE /v1/responses/{id} (OpenAI's
Responses API, serving_responses.py); GET /v1/models and /v1/models/{model}; POST /tokenize and
/detokenize (vLLM's shapes, serving_tokenization.py); GET and HEAD /health, GET /metrics (Prometheus),
GET /version. Errors use OpenAI's body (server_errors.py); the middlewares are in server_middleware.py,
the shutdown in server_shutdown.py.

This module assembles the app and runs it (`serve_main`, with the configs the command line made:
tp_overlap_plugin/cli/serve.py).
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from typing import Optional

from tp_overlap_plugin import options

from ...config import EngineConfig
from ...user_errors import DEBUG_HINT, CliError
from .server_config import DEFAULT_MAX_BODY_BYTES, ServerConfig, configure_logging

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from ...metrics import ServerMetrics
    from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                           DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                           TokenizeResponse, VersionResponse)
    from .protocol_responses import ResponseDeleted, ResponseObject, ResponsesRequest
    from .server_errors import (ERROR_RESPONSES, ApiError, check_encodable, describe_validation_errors,
                                error_response, internal_error_body, is_json_media_type)
    from .server_middleware import ApiKeyGuard, BodyCheck, ErrorBarrier, ResponseCounter
    from .server_shutdown import ABORT_GRACE_S, DrainGuard, DrainingServer, InFlight
    from .serving_chat import OpenAIServingChat
    from .serving_completion import OpenAIServingCompletion
    from .serving_responses import OpenAIServingResponses
    from .serving_tokenization import OpenAIServingTokenization
    _MISSING_EXTRA: Optional[ImportError] = None
except ImportError as _e:   # the `serve` extra is not installed: the CLI parser still works, serving does not
    _MISSING_EXTRA = _e

logger = logging.getLogger("tp_overlap.server")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tp-overlap")
    except PackageNotFoundError:   # running from a source tree that was never installed
        return "unknown"


class OpenAIServer:
    """The handlers of each API over one engine; `app` is the ASGI application (its FastAPI object is
    `app.fastapi`)."""

    def __init__(self, engine, served_model_name: str, api_key: Optional[str] = None,
                 model_root: Optional[str] = None, tool_parser: Optional[str] = None,
                 trust_request_chat_template: bool = False, max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.engine = engine
        self.model_name = served_model_name
        self.model_root = model_root
        self.metrics = ServerMetrics(served_model_name, self._stats, engine.max_model_len)
        self.in_flight = InFlight()
        shared = (engine, served_model_name, self.metrics, self.in_flight)
        self.completion = OpenAIServingCompletion(*shared)
        self.chat = OpenAIServingChat(*shared, tool_parser=tool_parser,
                                      trust_request_chat_template=trust_request_chat_template)
        self.responses = OpenAIServingResponses(*shared, tool_parser=tool_parser)
        self.tokenization = OpenAIServingTokenization(*shared, trust_request_chat_template=trust_request_chat_template)
        routes = self._routes()
        # the middlewares, outermost first (server_middleware.py)
        checked = BodyCheck(routes, max_request_body_bytes)
        inner = ApiKeyGuard(checked, api_key) if api_key else checked
        self.app = ResponseCounter(ErrorBarrier(DrainGuard(inner, self.in_flight)), self.metrics)
        # Route tables and the OpenAPI schema stay reachable on the FastAPI object.
        self.app.fastapi = routes

    def _stats(self) -> Optional[dict]:
        try:
            return self.engine.stats()
        except Exception:   # a shut-down engine has no stats to read
            return None

    def _routes(self) -> FastAPI:
        """The routes, as a FastAPI object (the middlewares go around it in __init__)."""
        version = package_version()
        app = FastAPI(title="tp-overlap OpenAI-compatible server", version=version,
                      description="A subset of the OpenAI API over the tp-overlap engine.")
        server = self

        @app.exception_handler(RequestValidationError)
        async def _validation(request: Request, exc: RequestValidationError):
            ctype = request.headers.get("content-type")
            if not is_json_media_type(ctype or "") and any(e.get("type") == "model_attributes_type"
                                                            for e in exc.errors()):
                # FastAPI reads a body as JSON only under a JSON content type (recent versions: only when
                # the header is there); otherwise it arrives as raw bytes, which would read as "not an
                # object" to a client that did send a JSON object.
                sent = f"sent as '{ctype}'" if ctype else "sent without a Content-Type header"
                return error_response(400, f"the request body was {sent}; send it as JSON with the header "
                                           f"'Content-Type: application/json'")
            msg, param = describe_validation_errors(exc.errors())
            return error_response(400, msg, param)

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, exc: ApiError):
            return error_response(exc.status, exc.message, exc.param, exc.code)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException):
            return error_response(exc.status_code, str(exc.detail))

        @app.exception_handler(Exception)
        async def _internal(request: Request, exc: Exception):
            logger.exception("unhandled error on %s", request.url.path)
            return JSONResponse(internal_error_body(exc), status_code=500)

        @app.post("/v1/completions", response_model=CompletionResponse, responses={
            **ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when streaming"}})
        async def completions(req: CompletionRequest, request: Request, response: Response):
            check_encodable(req)
            return _with_request_id(await server.completion.create(req, request), request, response)

        @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={
            **ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when streaming"}})
        async def chat_completions(req: ChatCompletionRequest, request: Request, response: Response):
            check_encodable(req)
            return _with_request_id(await server.chat.create(req, request), request, response)

        @app.post("/v1/responses", response_model=ResponseObject, responses={
            **ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when streaming"}})
        async def responses(req: ResponsesRequest, request: Request, response: Response):
            check_encodable(req)
            return _with_request_id(await server.responses.create(req, request), request, response)

        @app.get("/v1/responses/{response_id}", response_model=ResponseObject,
                 responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]})
        async def get_response(response_id: str):
            return server.responses.retrieve(response_id)

        @app.delete("/v1/responses/{response_id}", response_model=ResponseDeleted,
                    responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]})
        async def delete_response(response_id: str):
            return server.responses.delete(response_id)

        @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
        async def tokenize(req: TokenizeRequest):
            check_encodable(req)
            return server.tokenization.tokenize(req)

        @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
        async def detokenize(req: DetokenizeRequest):
            return server.tokenization.detokenize(req)

        def card() -> ModelCard:
            return ModelCard(id=server.model_name, root=server.model_root, max_model_len=server.engine.max_model_len)

        @app.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
        async def models():
            return ModelList(data=[card()])

        # `:path`: a served name may be a Hub id with a slash (org/name).
        @app.get("/v1/models/{model:path}", response_model=ModelCard,
                 responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]})
        async def model(model: str):
            server.completion.check_model(model)
            return card()

        @app.get("/health", responses={503: {"description": "the engine is dead"}})
        async def health():
            if server.engine.alive():
                return Response(status_code=200)
            return error_response(503, "the engine is not running; restart the server")

        # Its own route, not methods=["GET", "HEAD"]: the OpenAPI schema wants one operation id per method.
        app.head("/health", responses={503: {"description": "the engine is dead"}})(health)

        @app.get("/metrics", response_class=Response)
        async def metrics():
            return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/version", response_model=VersionResponse)
        async def version_route():
            return VersionResponse(version=version)

        return app


def _with_request_id(result, request: Request, response: Response):
    """The request's id (the client's X-Request-Id or request_id, else the response id) in the X-Request-Id
    header, as vLLM sends it: on a stream's own response, or on the one FastAPI renders the body into."""
    rid = getattr(request.state, "request_id", None)
    if rid is not None:
        (result if isinstance(result, Response) else response).headers["X-Request-Id"] = rid
    return result


def build_app(engine, served_model_name: str, api_key: Optional[str] = None, model_root: Optional[str] = None,
              tool_parser: Optional[str] = None, trust_request_chat_template: bool = False,
              max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The ASGI app for an AsyncLLM (the FastAPI object is its `.fastapi`, the requests in flight its
    `.in_flight`). `tool_parser`: the parser of tool_choice 'auto' (--enable-auto-tool-choice); None: off."""
    server = OpenAIServer(engine, served_model_name, api_key, model_root, tool_parser, trust_request_chat_template,
                          max_request_body_bytes)
    server.app.in_flight = server.in_flight
    return server.app


# ---- running it ----------------------------------------------------------------------------------
def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine loads: a port that cannot be had fails in a second,
    not after minutes of loading weights. (uvicorn starts listening on it once it serves.)"""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CliError(f"the server could not listen on {host}:{port}: {e.strerror or e}",
                       hint="choose another --port, or stop what uses it", status=1) from None
    return sock


def serve_main(cfg: EngineConfig, server: ServerConfig = ServerConfig()) -> int:
    """Start the engine and serve it until SIGINT/SIGTERM; 0 once it has drained and stopped. `cfg` has been
    checked (tp_overlap_plugin/cli/engine_args.py's check_engine_config) where a user typed it."""
    if _MISSING_EXTRA is not None:
        raise CliError(f"the server needs the serve extra: {_MISSING_EXTRA}", hint="pip install 'tp-overlap[serve]'")
    import uvicorn

    from ...config import env_rank_world
    from ...engine.async_llm import AsyncLLM

    configure_logging(server.log_level)
    t0 = time.perf_counter()

    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum} during start-up")

    launched = env_rank_world()
    if launched is not None and launched[0] != 0:
        # A torchrun worker rank serves rank 0's steps inside the engine constructor. torchrun forwards
        # Ctrl-C / SIGTERM to every rank; this one must not die mid-collective but wait for rank 0, which
        # gets the same signal, to finish its requests and send the stop. (torchrun escalates to SIGKILL
        # if rank 0 never does.)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: logger.info("rank %d: signal %d; waiting for rank 0 to stop",
                                                                 launched[0], signum))
        AsyncLLM(cfg)
        return 0
    sock = _listen(server.host, server.port)
    # Until uvicorn takes over the signals, a SIGTERM must unwind the engine start (which then stops the
    # workers it spawned) instead of killing this process and orphaning them.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        engine = AsyncLLM(cfg)
    except Exception as e:
        sock.close()
        # Nothing is served without an engine: exit with the reason, not a server that answers 503.
        raise CliError(f"the engine did not start: {e}", hint=DEBUG_HINT, status=1) from e
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        name = server.served_model_name or cfg.model
        body_limit = server.max_request_body_bytes or options.env_max_request_body_bytes() or DEFAULT_MAX_BODY_BYTES
        app = build_app(engine, name, server.api_key or options.env_api_key(vllm_too=True), model_root=cfg.model,
                        tool_parser=server.tool_parser, trust_request_chat_template=server.trust_request_chat_template,
                        max_request_body_bytes=body_limit)
        logger.info("engine ready in %.1f s: model %s, tp=%d, max_model_len=%d, %d KV blocks of %d tokens",
                    time.perf_counter() - t0, cfg.model, cfg.tensor_parallel_size, engine.max_model_len,
                    engine.num_blocks, cfg.block_size)
        # By then every request has ended (server_shutdown.py); this only bounds the closing of connections.
        config = uvicorn.Config(app, host=server.host, port=server.port, log_level=server.log_level,
                                access_log=server.access_log,
                                timeout_graceful_shutdown=ABORT_GRACE_S, lifespan="off")
        # DrainingServer handles SIGINT/SIGTERM while serving (server_shutdown.py); the engine and its workers
        # stop below. A signal after it returns, while the engine stops, only logs.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: logger.info("signal %d: the engine is stopping", signum))
        DrainingServer(config, app.in_flight, server.shutdown_timeout).run(sockets=[sock])
    finally:
        sock.close()
        engine.shutdown()
        logger.info("engine shut down")
    return 0
