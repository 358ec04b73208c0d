"""`LLMEngine`: the front end (front_end.py) over an engine core (core.py) in this process, for `LLM`
and for callers that step by hand.

- `add_request(id, prompt, params)` processes the request (input processing, once) then `add`s it;
  `add(id, processed)` takes a request processed elsewhere and trusts it.
- `step()` runs one core step and turns its token-id deltas into `RequestOutput`s through one
  `RequestStream` per request (text, stop strings). A request that a stop string ended is aborted in
  the core at once, as `AsyncLLM` aborts it in its core process.
"""

from __future__ import annotations

import itertools
from typing import Optional, Union

from ..config import EngineConfig, SamplingParams
from .core import EngineCore
from .front_end import FrontEnd
from .input_processor import Prompt
from .messages import OutputDelta, ProcessedRequest
from .outputs import RequestOutput
from .request_stream import RequestStream


class LLMEngine:
    """Single-threaded: add / abort / step. Not thread-safe."""

    def __init__(self, config: Optional[EngineConfig] = None, **kwargs):
        cfg = config if config is not None else EngineConfig(**kwargs)
        self.cfg = cfg
        self.core = EngineCore(cfg)   # under torchrun, ranks > 0 serve rank 0's steps in here
        self.is_driver = self.core.is_driver
        if not self.is_driver:
            return
        self.front = FrontEnd(*FrontEnd.load(cfg, self.core.mcfg), self.core.mcfg.vocab_size,
                              self.core.max_model_len)
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()

    # The core's state, for the tests and the bench scripts that look at it.
    mcfg = property(lambda self: self.core.mcfg)
    device = property(lambda self: self.core.device)
    max_model_len = property(lambda self: self.core.max_model_len)
    runner = property(lambda self: self.core.runner)
    workers = property(lambda self: self.core.workers)
    scheduler = property(lambda self: self.core.scheduler)
    block_manager = property(lambda self: self.core.block_manager)
    token_state = property(lambda self: self.core.token_state)
    last_result = property(lambda self: self.core.last_result)
    # The front end's.
    tokenizer = property(lambda self: self.front.tokenizer)
    input_processor = property(lambda self: self.front.input_processor)

    @property
    def eos_ids(self) -> set[int]:
        return self.front.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self.front.eos_ids = ids

    def shutdown(self) -> None:
        self.core.shutdown()

    # ---- requests ----------------------------------------------------------------------------
    def process_request(self, prompt: Prompt, params: Optional[Union[SamplingParams, dict]] = None
                        ) -> ProcessedRequest:
        """Validate and tokenize a request without touching engine state (safe from any thread)."""
        self.core._require_driver()
        return self.front.process(prompt, params)

    def add_request(self, request_id: Optional[str], prompt: Prompt,
                    params: Optional[Union[SamplingParams, dict]] = None) -> str:
        return self.add(request_id, self.process_request(prompt, params))

    def add(self, request_id: Optional[str], request: ProcessedRequest) -> str:
        """Schedule a processed request; nothing of it is checked again. Returns its id."""
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if request.params.structured_output is not None and request.grammar is None:
            # (a request that was pickled: the core here has no vocabulary of its own to compile against)
            request.grammar = self.front.input_processor.compile_grammar(request.params)
        self.core.add(rid, request)
        self._streams[rid] = self.front.stream(rid, request)
        return rid

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Drop a request now (its KV blocks are free when this returns): its last RequestOutput, or
        None if it is not here (finished, or never added)."""
        d = self.core.abort(str(request_id))
        stream = self._streams.pop(str(request_id), None)
        return None if d is None or stream is None else stream.output(d)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def stats(self) -> dict:
        return self.core.stats()

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One core step, as a RequestOutput per request it advanced."""
        return [out for d in self.core.step() if (out := self._output(d)) is not None]

    def _output(self, d: OutputDelta) -> Optional[RequestOutput]:
        stream = self._streams.get(d.request_id)
        if stream is None:   # a stop string ended it, and the core had computed a token more
            return None
        out = stream.output(d)
        if out.finished:
            del self._streams[d.request_id]
            if not d.finished:   # a stop string: the core would go on
                self.core.abort(d.request_id)
        return out
