"""The engine core: the step loop of an `AsyncLLM` in a process of its own, and the server's end of it.

Why a process: at 128 concurrent streams the HTTP server's event loop (SSE formatting, Starlette, h11)
and the step loop (scheduling, launching, detokenising) compete for one GIL, and a CUDA-graph decode
step then spends more host time launching than the GPU spends running it. Here the HTTP process keeps
tokenisation, validation and the per-request streams; the core process (`spawn`) owns the LLMEngine,
rank 0 of the TP group (it spawns the other ranks itself, as an offline engine does).

The channel is two one-way pipes:
- server -> core: ("add", request id, prompt text, prompt ids, SamplingParams), ("abort", request id),
  ("stop",); the core drains every waiting message before each step.
- core -> server: one message per step (or per batch of requests handled while no step runs),
  ("step", deltas, rejected, stats), where the deltas are
  `engine.output_delta` tuples of all requests that step advanced, `rejected` the (request id, message)
  of adds that failed in the core, and `stats` the engine's `stats()` after the step. Before the first:
  ("ready", info) or ("failed", message); at a failed step: ("error", exception) as the last message.
  Messages are pickled by hand (`send_bytes`): a tensor (prompt logits) then travels inline, not as
  a shared-memory handle.

A core that dies (killed, crashed) closes its pipe: the reader in the server sees the end of the
pipe at once, fails every open stream and the health check, and kills the TP ranks the core started.
A server that dies closes the other pipe: the core stops its engine (and its ranks) and exits.

`in_thread=True` runs the same loop on a thread of the server process over the same pipes (debugging,
profiling with one process); the HTTP server always uses a process.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
from typing import Callable, Optional

from .config import EngineConfig

log = logging.getLogger(__name__)

_PICKLE = pickle.HIGHEST_PROTOCOL


def _send(conn, msg) -> None:
    conn.send_bytes(pickle.dumps(msg, _PICKLE))


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e, _PICKLE))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _logging_setup() -> tuple[int, Optional[str]]:
    """This process's root log level and format, for the core: a spawned process starts with logging
    unconfigured, and the engine's start-up lines (the tables it loaded, the paths it chose) would be lost."""
    root = logging.getLogger()
    fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)
    return root.level, fmt


def run_core(cfg_json: str, requests, outputs, setup: Optional[Callable] = None, in_process: bool = True,
             logging_setup: Optional[tuple[int, Optional[str]]] = None) -> None:
    """The core's loop: build the engine, then add / abort / step until told to stop or the server
    goes away. `setup(engine)` runs once the engine is built (tests use it to inject faults)."""
    from .engine import LLMEngine

    if logging_setup is not None:
        level, fmt = logging_setup
        logging.basicConfig(level=level, **({"format": fmt} if fmt else {}))
    if in_process:
        # Ctrl-C reaches the whole process group: the server decides when the engine stops (it lets
        # in-flight streams finish first). SIGTERM (the server's last resort) unwinds, stopping the ranks.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    eng = None
    try:
        try:
            eng = LLMEngine(EngineConfig.model_validate_json(cfg_json))
            eng.emit_deltas = True
            if setup is not None:
                setup(eng)
        except BaseException as e:
            _send(outputs, ("failed", f"{e}"))
            return
        _send(outputs, ("ready", {
            "max_model_len": eng.max_model_len, "vocab_size": eng.mcfg.vocab_size, "eos_ids": sorted(eng.eos_ids),
            "num_blocks": eng.block_manager.num_blocks, "block_size": eng.cfg.block_size,
            "worker_pids": [p.pid for p in eng.workers.procs], "stats": eng.stats()}))
        _serve(eng, requests, outputs)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass   # the server went away; nobody is left to tell
    finally:
        if eng is not None:
            eng.shutdown()


def _serve(eng, requests, outputs) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from .engine import output_delta
    from .scheduler import Status

    # Grammars are compiled on a thread: a new JSON schema takes tens of ms, and xgrammar releases the
    # GIL meanwhile, so steps go on. The server compiled it already (its errors are its 400s) but
    # compiled grammars do not pickle; xgrammar caches them, so a repeated schema costs ~0.1 ms here.
    compiler = None
    compiling: dict = {}   # request id -> (future, text, ids, params)
    while True:
        if eng.has_unfinished():
            wait = 0.0          # busy: take what is there, then step
        elif compiling:
            wait = 0.002        # only grammars in progress: look at them again soon
        else:
            wait = None         # idle: block until a request (or the end of the pipe)
        msgs = []
        if wait is None or requests.poll(wait):
            msgs.append(requests.recv())
        while requests.poll(0):
            msgs.append(requests.recv())
        outs, rejected = [], []
        for msg in msgs:
            kind = msg[0]
            if kind == "add":
                _, rid, text, ids, params = msg
                if params.structured_output is not None:
                    if compiler is None:
                        compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                    compiling[rid] = (compiler.submit(eng.structured.compile, params.structured_output),
                                      text, ids, params)
                    continue
                try:
                    eng.add_sequence(eng.sequence_of(rid, text, ids, params))
                except Exception as e:
                    rejected.append((rid, f"{e}"))
            elif kind == "abort":
                rid = msg[1]
                if rid in compiling:   # never scheduled: it ends here, as an abort would
                    fut, text, ids, params = compiling.pop(rid)
                    fut.cancel()
                    seq = eng.sequence_of(rid, text, ids, params)
                    seq.status, seq.finish_reason = Status.FINISHED, "abort"
                    outs.append(output_delta(seq, "", []))
                    continue
                out = eng.abort_request(rid)
                if out is not None:
                    outs.append(out)
            elif kind == "stop":
                if compiler is not None:
                    compiler.shutdown(wait=False, cancel_futures=True)
                return
        for rid in [r for r, (fut, *_) in compiling.items() if fut.done()]:
            fut, text, ids, params = compiling.pop(rid)
            try:
                eng.add_sequence(eng.sequence_of(rid, text, ids, params, fut.result()))
            except Exception as e:
                rejected.append((rid, f"{e}"))
        stepped = eng.has_unfinished()
        if stepped:
            try:
                outs += eng.step()
            except BaseException as e:   # a broken engine fails every open stream, never silently
                _send(outputs, ("error", _portable(e)))
                return
        if stepped or msgs or rejected:   # not while only waiting for a grammar
            _send(outputs, ("step", outs, rejected, eng.stats()))


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
        args = (cfg.model_dump_json(), req_r, out_w, setup)
        if in_thread:
            self.proc = threading.Thread(target=run_core, args=args + (False,), name="engine-core", daemon=True)
        else:
            self.proc = ctx.Process(target=run_core, args=args, kwargs={"logging_setup": _logging_setup()},
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
        self.stats = self.info["stats"]
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> Optional[int]:
        return None if self.in_thread else self.proc.pid

    def _wait_ready(self) -> dict:
        while not self._out.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process exited during start-up ({self._exit_text()})")
        try:
            kind, info = pickle.loads(self._out.recv_bytes())
        except EOFError:
            raise RuntimeError(f"the engine core process exited during start-up ({self._exit_text()})") from None
        if kind == "failed":
            raise RuntimeError(info)
        return info

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

    def send(self, msg: tuple) -> None:
        """Post a request or abort. A core that is gone raises RuntimeError."""
        try:
            with self._send_lock:
                _send(self._req, msg)
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
            if msg[0] == "step":
                self.stats = msg[3]
                self._on_step(msg[1], msg[2])
            elif msg[0] == "error":   # the core stops its ranks itself, then exits
                self._failed = True
                self._on_error(msg[1])
                return

    def _kill_ranks(self) -> None:
        """The TP ranks of a core that died would wait for it until their timeout: end them now."""
        if self.in_thread:
            return
        for pid in self.info.get("worker_pids", []):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _stop_core(self, grace_s: float) -> None:
        self._stopping = True
        try:
            self.send(("stop",))
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

