"""What `serve_main` takes besides the EngineConfig: where the server listens and how it behaves.
The command line (tp_overlap_plugin/cli/serve.py) fills it; its defaults are the options' defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

LogLevel = Literal["critical", "error", "warning", "info", "debug"]


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # None: $TP_OVERLAP_API_KEY when the server starts (else no key); not a default that --help would print
    api_key: Optional[str] = None
    # the model name clients send; None: the engine's --model value
    served_model_name: Optional[str] = None
    # seconds the requests in flight get to finish after the first SIGINT/SIGTERM (server_shutdown.py)
    shutdown_timeout: float = 10.0
    log_level: LogLevel = "info"
    access_log: bool = True
    # the tool-call parser of tool_choice 'auto' (tool_parsers.PARSERS); None: 'auto' is refused
    tool_parser: Optional[str] = None


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """The server's log format at `level`; a no-op once logging is configured (the command configures it
    first, so that its own warnings come out in the same format)."""
    import logging

    logging.basicConfig(level=getattr(logging, level.upper()), format=LOG_FORMAT)
