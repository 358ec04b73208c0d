"""The client's end of the engine core: starts the core process (core_process.py), sends it
requests, and hands each step's message to a callback on its reader thread.

A core that dies (killed, crashed) closes its pipe: the reader sees the end of the pipe at once, fails
every open stream and the health check through `on_error`, and kills the TP ranks the core started.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
from typing import Callable, Optional, Union

from ..config import EngineConfig
from .core_process import parent_logging, run_core, send
from .messages import (AbortRequest, AddRequest, CoreFailed, CoreInfo, CoreStartFailed, StepOutputs,
                       StopCore)

log = logging.getLogger(__name__)


class EngineCoreClient:
    """The server's end: starts the core, sends requests, and hands each step's message to `on_step`
    (on its reader thread) and a dead or failed core to `on_error`, once."""

    def __init__(self, cfg: EngineConfig, on_step: Callable, on_error: Callable[[BaseException], None],
                 in_thread: bool = False, setup: Optional[Callable] = None):
        self._on_step, self._on_error = on_step, on_error
        self._stopping = False
        self._failed = False
        self._send_lock = threading.Lock()
        self.stats: dict = {}
        ctx = mp.get_context("spawn")
        req_r, self._req = ctx.Pipe(duplex=False)
        self._out, out_w = ctx.Pipe(duplex=False)
        # the config itself, as the front end holds it: spawn pickles it, and the core hands the same on
        # to the ranks it spawns (no dump to JSON and parse back at either boundary)
        args = (cfg, req_r, out_w, setup)
        if in_thread:
            self.proc = threading.Thread(target=run_core, args=args + (False,), name="engine-core", daemon=True)
        else:
            self.proc = ctx.Process(target=run_core, args=args, kwargs={"logging_setup": parent_logging()},
                                    name="tp-overlap-engine-core")
        self.in_thread = in_thread
        self.proc.start()
        if not in_thread:
            # Only the core holds its ends now, so its death is the end of our pipe.
            req_r.close()
            out_w.close()
        try:
            self.info = self._wait_ready()
        except RuntimeError:   # the core failed and is on its way out
            self._stop_core(grace_s=30)
            raise
        except BaseException:
            # Interrupted (Ctrl-C, the server's SIGTERM handler) while the core loads the model and reads
            # no messages: SIGTERM unwinds its start, which stops any ranks it spawned.
            self._stop_core(grace_s=0)
            raise
        self.stats = self.info.stats
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> Optional[int]:
        return None if self.in_thread else self.proc.pid

    def _wait_ready(self) -> CoreInfo:
        while not self._out.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process exited during start-up ({self._exit_text()})")
        try:
            msg = pickle.loads(self._out.recv_bytes())
        except EOFError:
            raise RuntimeError(f"the engine core process exited during start-up ({self._exit_text()})") from None
        if isinstance(msg, CoreStartFailed):
            raise RuntimeError(msg.message)
        return msg.info

    def _exit_text(self) -> str:
        if self.in_thread:
            return "its thread ended"
        self.proc.join(timeout=5)
        code = self.proc.exitcode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def alive(self) -> bool:
        return not self._failed and not self._stopping and self.proc.is_alive()

    def send(self, msg: Union[AddRequest, AbortRequest, StopCore]) -> None:
        """Post a request or abort. A core that is gone raises RuntimeError."""
        try:
            with self._send_lock:
                send(self._req, msg)
        except (OSError, ValueError) as e:   # a closed pipe, or one the shutdown closed
            raise RuntimeError(f"the engine core is not running: {e}") from None

    def _read(self) -> None:
        while True:
            try:
                msg = pickle.loads(self._out.recv_bytes())
            except (EOFError, OSError):
                if not self._stopping:
                    self._failed = True
                    self._kill_ranks()
                    self._on_error(RuntimeError(f"the engine core process (pid {self.pid}) died: {self._exit_text()}"))
                return
            if isinstance(msg, StepOutputs):
                self.stats = msg.stats
                self._on_step(msg.deltas, msg.rejected)
            elif isinstance(msg, CoreFailed):   # the core stops its ranks itself, then exits
                self._failed = True
                self._on_error(msg.error)
                return

    def _kill_ranks(self) -> None:
        """The TP ranks of a core that died would wait for it until their timeout: end them now."""
        if self.in_thread:
            return
        for pid in self.info.worker_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _stop_core(self, grace_s: float) -> None:
        self._stopping = True
        try:
            self.send(StopCore())
        except RuntimeError:
            pass
        self.proc.join(timeout=grace_s)
        if self.proc.is_alive() and not self.in_thread:
            log.warning("the engine core did not stop within %.0f s; terminating it", grace_s)
            self.proc.terminate()   # its SIGTERM handler still stops the TP ranks
            self.proc.join(timeout=20)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)

    def shutdown(self, grace_s: float = 60) -> None:
        if self._stopping:
            return
        self._stop_core(grace_s)
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join(timeout=10)
        for conn in (self._req, self._out):
            conn.close()

