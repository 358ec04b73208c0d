"""`AsyncLLM`: the streaming API for servers: the front end (front_end.py) in this process, over an
engine core in a process of its own.

This process keeps what needs the tokenizer or is per request: input processing (validate and
tokenize, once), and per stream one asyncio queue and one `RequestStream` (detokenizing, stop
strings). The core client (core_client.py) carries processed requests to the core process and each
step's token-id deltas back; they are fanned out to the streams' queues on the client's reader
thread, one wake-up per event loop, and turned into text by each stream's consumer. No coroutine
waits for a model step.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import threading
import weakref
from typing import AsyncIterator, Optional, Union

from ..config import EngineConfig, SamplingParams, env_rank_world
from .core import EngineCore
from .core_client import EngineCoreClient
from .front_end import FrontEnd
from .input_processor import Prompt
from .messages import AbortRequest, AddRequest, GrammarVocabulary, OutputDelta, ProcessedRequest
from .outputs import RequestOutput
from .request_stream import RequestStream


class AsyncLLM:
    """Streaming API for servers. The step loop runs in an engine-core process of its own
    (core_process.py says why and how); this process validates requests, keeps one asyncio
    queue per stream and fans each step's outputs out to them. No coroutine waits for a model step.

        engine = AsyncLLM(EngineConfig(...))
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.delta_text)
        engine.abort("req-1")

    `in_thread=True` runs the same core loop on a thread of this process instead (debugging).
    `core_setup(core)` runs in the core process once its EngineCore is built; it must pickle (a module-level
    function), and tests use it to inject faults. Under torchrun, ranks > 0 serve rank 0's steps in
    this constructor (`is_driver` False); rank 0's core process inherits the launch environment.
    """

    def __init__(self, config: Optional[EngineConfig] = None, *, in_thread: bool = False, core_setup=None,
                 **kwargs):
        cfg = config if config is not None else EngineConfig(**kwargs)
        launched = env_rank_world()
        self.is_driver = launched is None or launched[0] == 0
        if not self.is_driver:
            EngineCore(cfg)   # serves rank 0's steps until it shuts down
            return
        self.cfg = cfg
        self.mcfg = cfg.load_model_config()
        self.mcfg.check_tp(cfg.tensor_parallel_size)   # fail before any process is spawned
        tokenizer, eos_ids = FrontEnd.load(cfg, self.mcfg)   # likewise
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, RequestStream]] = {}
        self._error: Optional[BaseException] = None
        self._stopped = False
        self._ids = itertools.count()
        self.core = EngineCoreClient(cfg, self._on_step, self._on_error, in_thread=in_thread, setup=core_setup)
        info = self.core.info
        self.max_model_len: int = info.max_model_len
        self.vocab_size: int = info.vocab_size
        self.num_blocks: int = info.num_blocks
        self.front = FrontEnd(tokenizer, eos_ids, self.vocab_size, self.max_model_len)
        self.tokenizer = self.front.tokenizer
        self.input_processor = self.front.input_processor
        self._vocabulary_sent = False   # the core compiles grammars against it (messages.GrammarVocabulary)
        self._vocabulary_lock = threading.Lock()
        ref = weakref.ref(self)
        # Before multiprocessing's own exit hook, which would wait for the core forever.
        atexit.register(lambda: ref() is not None and ref().shutdown())

    # ---- the core's side (its reader thread) -------------------------------------------------
    def _on_step(self, deltas: list[OutputDelta], rejected: list[tuple[str, str]]) -> None:
        """One message per step: group its items by the event loop of their stream, one wake-up each."""
        by_loop: dict = {}
        for d in deltas:
            t = self._streams.get(d.request_id)
            if t is not None:
                by_loop.setdefault(t[0], []).append((t[1], d))
        for rid, msg in rejected:
            t = self._streams.get(rid)
            if t is not None:
                by_loop.setdefault(t[0], []).append((t[1], RuntimeError(f"the engine rejected the request: {msg}")))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:   # the consumer's event loop is gone
                pass

    def _on_error(self, e: BaseException) -> None:
        self._error = e
        self._fail_streams(e)

    def _fail_streams(self, e: BaseException) -> None:
        for loop, q, _ in list(self._streams.values()):
            try:
                loop.call_soon_threadsafe(q.put_nowait, e)
            except RuntimeError:
                pass

    # ---- requests ----------------------------------------------------------------------------
    def alive(self) -> bool:
        """True while the engine can serve (the health check)."""
        return self._error is None and not self._stopped and self.core.alive()

    def stats(self) -> dict:
        """The core's `EngineCore.stats()` after its latest step."""
        return self.core.stats

    def _require_running(self) -> None:
        if self._stopped:
            raise RuntimeError("the engine has been shut down")
        if self._error is not None:
            raise RuntimeError(f"the engine failed earlier and must be restarted: {self._error}")

    def process_request(self, prompt: Prompt, params: Optional[Union[SamplingParams, dict]] = None
                        ) -> ProcessedRequest:
        """Validate and tokenize a request here, before it reaches the core (input_processor.py): the
        processed request for `generate`, or the error that names what is wrong; RuntimeError when
        the engine cannot serve."""
        self._require_running()
        return self.front.process(prompt, params)

    @property
    def eos_ids(self) -> set[int]:
        return self.front.eos_ids

    async def generate(self, prompt: Union[Prompt, ProcessedRequest],
                       params: Optional[Union[SamplingParams, dict]] = None,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. `prompt` is a prompt with its `params`, or a request that
        `process_request` returned (then `params` is None): it is trusted, not checked again."""
        if self._error is not None:
            raise RuntimeError(f"the engine loop died: {self._error!r}")
        if self._stopped:
            raise RuntimeError("the engine has been shut down")
        if request_id is not None and str(request_id) in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, ProcessedRequest):
            if params is not None:
                raise TypeError("a processed request carries its sampling params; pass params=None")
            request = prompt
        else:
            request = self.front.process(prompt, params)   # raises on bad input, here
        rid = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        q: asyncio.Queue = asyncio.Queue()
        stream = self.front.stream(rid, request)
        self._streams[rid] = (asyncio.get_running_loop(), q, stream)
        finished = False
        try:
            if self._error is not None:   # failed while this stream registered: no one would tell it
                raise RuntimeError(f"the engine loop died: {self._error!r}")
            if request.params.structured_output is not None:
                self._send_vocabulary()
            self.core.send(AddRequest(rid, request))
            while True:
                d = await q.get()
                if isinstance(d, BaseException):
                    if d is self._error:
                        raise RuntimeError(f"the engine loop died: {d!r}") from d
                    raise d
                out = stream.output(d)
                finished = out.finished
                if finished and not d.finished:   # a stop string ended it: the core would go on
                    self.abort(rid)
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and self._error is None and not self._stopped:
                # The consumer went away (client disconnect, cancellation): free the blocks.
                self.abort(rid)

    def _send_vocabulary(self) -> None:
        """Before the first request with a structured output: the core compiles its grammars against
        the front end's vocabulary (it has no tokenizer)."""
        with self._vocabulary_lock:
            if not self._vocabulary_sent:
                self.core.send(GrammarVocabulary(self.front.grammar_vocabulary()))
                self._vocabulary_sent = True

    def abort(self, request_id: str) -> None:
        """Abort a request; the core frees its blocks before its next step."""
        try:
            self.core.send(AbortRequest(str(request_id)))
        except RuntimeError:
            pass   # no core, no request to abort

    def shutdown(self) -> None:
        if not self.is_driver or self._stopped:
            return
        self._stopped = True
        self.core.shutdown()
        self._fail_streams(RuntimeError("the engine has been shut down"))


def _put_all(items: list) -> None:
    for q, d in items:
        q.put_nowait(d)
