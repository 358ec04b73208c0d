"""What `serve_main` takes besides the EngineConfig: where the server listens and how it behaves.
The command line (tp_overlap_plugin/cli/serve.py) fills it; its defaults are the options' defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

LogLevel = Literal["critical", "error", "warning", "info", "debug"]
# The default request body limit (--max-request-body-bytes): far above any request this API takes in
# practice (a long chat with tools; a long context's prompt as token ids is about 1 MB), far below what
# would hurt the server to hold.
DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # None: $TP_OVERLAP_API_KEY, else $VLLM_API_KEY, when the server starts (else no key); not a default that
    # --help would print
    api_key: Optional[str] = None
    # the model name clients send; None: the engine's --model value
    served_model_name: Optional[str] = None
    # seconds the requests in flight get to finish after the first SIGINT/SIGTERM (server_shutdown.py)
    shutdown_timeout: float = 10.0
    log_level: LogLevel = "info"
    access_log: bool = True
    # the tool-call parser of tool_choice 'auto' (tool_parsers.PARSERS); None: 'auto' is refused
    tool_parser: Optional[str] = None
    # a larger request body is a 413 (server_middleware.BodyCheck); None: $TP_OVERLAP_MAX_REQUEST_BODY_BYTES,
    # else DEFAULT_MAX_BODY_BYTES (8 MiB)
    max_request_body_bytes: Optional[int] = None
    # vLLM's --trust-request-chat-template: run the Jinja chat_template a request sends (else a 400)
    trust_request_chat_template: bool = False


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """The server's log format at `level`; a no-op once logging is configured (the command configures it
    first, so that its own warnings come out in the same format)."""
    import logging

    logging.basicConfig(level=getattr(logging, level.upper()), format=LOG_FORMAT)
