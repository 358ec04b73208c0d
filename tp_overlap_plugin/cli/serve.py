"""`tp-overlap serve`: the server's options, turned into the ServerConfig that serve_main takes
(serving/entrypoints/openai/)."""

from __future__ import annotations

import argparse
import logging

from tp_overlap_plugin.serving.entrypoints.openai.server_config import (DEFAULT_MAX_BODY_BYTES, ServerConfig,
                                                                        configure_logging)
from tp_overlap_plugin.serving.entrypoints.openai.tool_parsers import PARSERS
from tp_overlap_plugin.serving.user_errors import CliError

from .engine_args import add_engine_args, engine_config_from_args
from .parser import add_debug_arg

logger = logging.getLogger("tp_overlap.server")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port: it must be in 0-65535")
    return port


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a positive number")
    return n


def add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="bind address (0.0.0.0 for all)")
    g.add_argument("--port", type=_port, default=d.port, help="TCP port")
    # Read from the environment at start, not as the option's default: --help would print the key.
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                        "(default: $TP_OVERLAP_API_KEY, else $VLLM_API_KEY, else none)")
    g.add_argument("--max-request-body-bytes", type=_positive_int, default=None,
                   help="a request body larger than this is refused with 413 (default: "
                        f"$TP_OVERLAP_MAX_REQUEST_BODY_BYTES, else {DEFAULT_MAX_BODY_BYTES} = 8 MiB)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="run the Jinja chat_template a request may send (vLLM's flag; without it such a request "
                        "is a 400). A template is code: allow it only for clients you trust")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on the first SIGINT/SIGTERM the server takes no new requests (they get a 503) and gives "
                        "those in flight this many seconds to finish; then it aborts them (streams end with "
                        "finish_reason 'abort' and [DONE]) and exits. A second signal aborts at once")
    g.add_argument("--log-level", default=d.log_level, choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's and uvicorn's log level")
    g.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (the default when a request has tools): calls are parsed out of "
                        "the reply with --tool-call-parser. 'required' and a named function work without it")
    g.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="the format of the model's tool calls: hermes (Qwen2.5, Qwen3, the demo model), "
                        "llama3_json (Llama 3.1, 3.2)")


def tool_parser_from_args(a: argparse.Namespace) -> str | None:
    """The parser tool_choice 'auto' uses, or None when it is off; CliError for a flag without the other."""
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        raise CliError("--enable-auto-tool-choice needs --tool-call-parser to say how the model writes its calls",
                       hint=f"add --tool-call-parser with one of: {', '.join(sorted(PARSERS))}")
    if a.tool_call_parser is not None and not a.enable_auto_tool_choice:
        logger.warning("--tool-call-parser %s is not used without --enable-auto-tool-choice: tool_choice 'auto' "
                       "is refused", a.tool_call_parser)
    return a.tool_call_parser if a.enable_auto_tool_choice else None


def server_config_from_args(a: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=a.host, port=a.port, api_key=a.api_key, served_model_name=a.served_model_name,
                        shutdown_timeout=a.shutdown_timeout, log_level=a.log_level, access_log=not a.no_access_log,
                        tool_parser=tool_parser_from_args(a), max_request_body_bytes=a.max_request_body_bytes,
                        trust_request_chat_template=a.trust_request_chat_template)


def run_serve(a: argparse.Namespace) -> int:
    """OpenAI-compatible HTTP server over the engine (api_server.py)."""
    from tp_overlap_plugin.serving.entrypoints.openai.api_server import serve_main

    configure_logging(a.log_level)   # before the checks below log anything
    cfg = engine_config_from_args(a)
    return serve_main(cfg, server_config_from_args(a))


def add_serve_subcommand(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the built-in demo model)")
    add_engine_args(s)
    add_server_args(s)
    add_debug_arg(s)
    s.set_defaults(func=run_serve)
    return s
