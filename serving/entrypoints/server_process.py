"""`tp-overlap serve` in a subprocess (`ServerProcess`), for the tests and the bench/ tools that drive a
server over HTTP (bench/serve_load.py, bench/serve_timeline.py): one helper both import, in the package,
so that a bench tool never imports integration_tests/."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Optional

# what ServerProcess runs: the `tp-overlap` command (tp_overlap_plugin/cli/)
COMMAND = ["-m", "tp_overlap_plugin.cli", "serve"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # A test run that is killed outright (no fixture teardown) must not leave a server behind: the kernel
    # sends SIGTERM to the server when its parent dies.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


class ServerProcess:
    """`tp-overlap serve ARGS` in its own process group on a free port; waits until /health answers 200.

        with ServerProcess(["--max-model-len", "256"]) as srv:
            httpx.get(srv.url + "/v1/models")

    Exiting the block sends SIGTERM (graceful), then SIGKILL to the whole group (TP workers included)
    if it has not exited within `stop_timeout`.
    """

    def __init__(self, args: list[str], start_timeout: float = 120.0, stop_timeout: float = 30.0,
                 log_path: Optional[str] = None, env: Optional[dict] = None, launcher: Optional[list[str]] = None):
        self.port = free_port()
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.args = list(args)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.log_path = log_path
        self.env = env
        # What runs COMMAND: this Python, or e.g. ["torchrun", "--nproc-per-node", "2"].
        self.launcher = list(launcher) if launcher else [sys.executable]
        self.proc: Optional[subprocess.Popen] = None
        self._log = None
        self._own_log = log_path is None

    def start(self) -> "ServerProcess":
        import tempfile

        import httpx

        cmd = [*self.launcher, *COMMAND, "--host", self.host, "--port", str(self.port), *self.args]
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="tp-overlap-serve-", suffix=".log")
            os.close(fd)
        self._log = open(self.log_path, "w")
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"the server did not become healthy within {self.start_timeout} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"

    def terminate(self, sig: int = signal.SIGTERM) -> Optional[int]:
        """Signal the server and wait up to stop_timeout; returns its exit code, or None if it had to be killed."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)   # its own session: the server and its TP workers
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        try:
            self.terminate()
        finally:
            # Workers of a server that exited cleanly are gone already; this catches anything left over.
            self.kill()
            if self._log is not None:
                self._log.close()
                self._log = None
            if self._own_log and self.log_path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.log_path)

    def __enter__(self) -> "ServerProcess":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
