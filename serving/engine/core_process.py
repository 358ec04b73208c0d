"""The engine core process: an `AsyncLLM`'s `EngineCore` (core.py) and its step loop, in a process of
its own.

Why a process: at 128 concurrent streams the HTTP server's event loop (SSE formatting, Starlette, h11)
and the step loop (scheduling, launching) compete for one GIL, and a CUDA-graph decode step then spends
more host time launching than the GPU spends running it. The HTTP process keeps the front end
(front_end.py: tokenizer, input processing, detokenizing, stop strings, the per-request streams); the
core process (`spawn`) owns the EngineCore: scheduler, KV blocks, sampling state and rank 0 of the TP
group (it spawns the other ranks itself, as an offline engine does). It takes processed requests
(token ids and sampling params) and sends token-id deltas back; it builds no tokenizer.

The channel is two one-way pipes carrying the message types of messages.py; the core imports
nothing else of the front end (integration_tests/test_engine_core_layout.py checks it).

A core that dies (killed, crashed) closes its pipe: the reader in the server sees the end of the
pipe at once, fails every open stream and the health check, and kills the TP ranks the core started.
A server that dies closes the other pipe: the core stops its engine (and its ranks) and exits.

`in_thread=True` (core_client.py) runs the same loop on a thread of the server process over the same
pipes (debugging, profiling with one process); the HTTP server always uses a process.
"""

from __future__ import annotations

import logging
import pickle
import signal
from typing import Callable, Optional

from ..config import EngineConfig
from .core import EngineCore
from .messages import (AbortRequest, AddRequest, CoreFailed, CoreInfo, CoreReady, CoreStartFailed,
                       GrammarVocabulary, OutputDelta, StepOutputs, StopCore)

log = logging.getLogger(__name__)

_PICKLE = pickle.HIGHEST_PROTOCOL


def send(conn, msg) -> None:
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


def parent_logging() -> tuple[int, Optional[str]]:
    """This process's root log level and format, for the core: a spawned process starts with logging
    unconfigured, and the engine's start-up lines (the tables it loaded, the paths it chose) would be lost."""
    root = logging.getLogger()
    fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)
    return root.level, fmt


def run_core(cfg: EngineConfig, requests, outputs, setup: Optional[Callable] = None, in_process: bool = True,
             logging_setup: Optional[tuple[int, Optional[str]]] = None) -> None:
    """The core's loop: build the EngineCore, then add / abort / step until told to stop or the server
    goes away. `setup(core)` runs once the core is built (tests use it to inject faults)."""
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
            eng = EngineCore(cfg)
            if setup is not None:
                setup(eng)
        except BaseException as e:
            send(outputs, CoreStartFailed(f"{e}"))
            return
        send(outputs, CoreReady(CoreInfo(
            max_model_len=eng.max_model_len, vocab_size=eng.mcfg.vocab_size,
            num_blocks=eng.block_manager.num_blocks, block_size=eng.cfg.block_size,
            worker_pids=[p.pid for p in eng.workers.procs], stats=eng.stats())))
        _serve(eng, requests, outputs)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass   # the server went away; nobody is left to tell
    finally:
        if eng is not None:
            eng.shutdown()


def _serve(eng: EngineCore, requests, outputs) -> None:
    from concurrent.futures import ThreadPoolExecutor

    # Grammars are compiled on a thread: a new JSON schema takes tens of ms, and xgrammar releases the
    # GIL meanwhile, so steps go on. The request side compiled it already (to reject a bad schema) but
    # compiled grammars do not pickle; xgrammar caches them, so a repeated schema costs ~0.1 ms here.
    compiler = None
    compiling: dict = {}   # request id -> (future, processed request)
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
        outs: list[OutputDelta] = []
        rejected: list[tuple[str, str]] = []
        for msg in msgs:
            if isinstance(msg, AddRequest):
                rid, req = msg.request_id, msg.request
                if req.params.structured_output is not None:
                    if compiler is None:
                        compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                    compiling[rid] = (compiler.submit(eng.structured.compile, req.params.structured_output), req)
                    continue
                try:
                    eng.add(rid, req)
                except Exception as e:
                    rejected.append((rid, f"{e}"))
            elif isinstance(msg, AbortRequest):
                rid = msg.request_id
                if rid in compiling:   # never scheduled: it ends here, as an abort would
                    compiling.pop(rid)[0].cancel()
                    outs.append(OutputDelta.aborted(rid))
                    continue
                out = eng.abort(rid)
                if out is not None:
                    outs.append(out)
            elif isinstance(msg, GrammarVocabulary):
                eng.structured.receive_vocabulary(msg.tokenizer_info)
            elif isinstance(msg, StopCore):
                if compiler is not None:
                    compiler.shutdown(wait=False, cancel_futures=True)
                return
        for rid in [r for r, (fut, _) in compiling.items() if fut.done()]:
            fut, req = compiling.pop(rid)
            try:
                req.grammar = fut.result()
                eng.add(rid, req)
            except Exception as e:
                rejected.append((rid, f"{e}"))
        stepped = eng.has_unfinished()
        if stepped:
            try:
                outs += eng.step()
            except BaseException as e:   # a broken engine fails every open stream, never silently
                send(outputs, CoreFailed(_portable(e)))
                return
        if stepped or msgs or rejected:   # not while only waiting for a grammar
            send(outputs, StepOutputs(outs, rejected, eng.stats()))
