"""`CliError`: a failure the user can act on, said as one line and a hint, without a traceback.

The server and the benchmarks raise it (a busy port, a server that cannot be reached); the command
(tp_overlap_plugin/cli/) prints it. It lives here, below both, so that serving/ never imports the
command.
"""

from __future__ import annotations

from typing import Optional

DEBUG_HINT = "--debug shows the traceback"


class CliError(Exception):
    """The exit status is 2 for a bad command line or config, 1 for a failure while running."""

    def __init__(self, message: str, hint: Optional[str] = None, status: int = 2):
        super().__init__(message)
        self.message = " ".join(message.split())    # one line, whatever the cause's formatting
        self.hint = hint
        self.status = status
