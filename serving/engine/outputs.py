"""What the engine hands back: one `OutputDelta` per request per step, and the `RequestOutput` a caller
reads, rebuilt from the deltas by the request's `RequestStream`.

One path for both engines: the LLM engine emits deltas; in-process (`LLMEngine.step`, `LLM`) a stream
per request turns them into RequestOutputs at once; under `AsyncLLM` the core process pickles the
deltas of each step into one message and the streams live in the server's process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol

if TYPE_CHECKING:
    import torch

    from ..config import SamplingParams

TopLogprobs = list[tuple[int, float]]   # per token: its top_logprobs most likely (id, logprob), best first


@dataclass(slots=True)
class FinalOutput:
    """A finished request's whole output: a stop string may cut text that an earlier delta carried."""
    text: str
    token_ids: list[int]
    logprobs: Optional[list[float]]
    top_logprobs: Optional[list[TopLogprobs]]
    prompt_logits: Optional["torch.Tensor"]   # [prompt_len, vocab] when asked for


@dataclass(slots=True)
class OutputDelta:
    """What one step added to one request (slots: small to pickle, a list of them per step)."""
    request_id: str
    text: str                                   # the new text
    token_ids: list[int]                        # the new tokens
    logprobs: Optional[list[float]]             # theirs, when the request asked for logprobs
    top_logprobs: Optional[list[TopLogprobs]]   # theirs, when it asked for top_logprobs
    finish_reason: Optional[str]                # "stop" | "length" | "abort" on the last delta, else None
    num_preemptions: int
    final: Optional[FinalOutput] = None         # set on the last delta

    @property
    def finished(self) -> bool:
        return self.final is not None

    @classmethod
    def aborted(cls, request_id: str) -> "OutputDelta":
        """The only delta of a request that ends before it was ever scheduled."""
        return cls(request_id, "", [], None, None, "abort", 0, FinalOutput("", [], None, None, None))


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[float]]
    finish_reason: Optional[str]   # "stop" | "length" | "abort" | None while running
    # per token, its top_logprobs most likely (id, logprob), best first, when asked for
    top_logprobs: Optional[list[TopLogprobs]] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    prompt_logits: Optional["torch.Tensor"] = None   # [prompt_len, vocab] when requested, once finished
    num_preemptions: int = 0


class StreamedRequest(Protocol):
    """What a stream reads of its request (a messages.ProcessedRequest: that module imports this one,
    for the deltas, so this one names no type of it)."""
    prompt: Optional[str]
    prompt_ids: list[int]
    params: "SamplingParams"


class RequestStream:
    """One request's RequestOutputs, rebuilt from its deltas on the receiving side."""

    def __init__(self, request_id: str, request: StreamedRequest):
        self.request_id = request_id
        self.prompt, self.prompt_ids, self.params = request.prompt, request.prompt_ids, request.params
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs] = []

    def output(self, d: OutputDelta) -> RequestOutput:
        fin = d.final
        if fin is not None:
            self.text, self.token_ids = fin.text, fin.token_ids
            self.logprobs, self.top_logprobs = fin.logprobs or [], fin.top_logprobs or []
        else:
            self.text += d.text
            self.token_ids += d.token_ids
            if d.logprobs:
                self.logprobs += d.logprobs
            if d.top_logprobs:
                self.top_logprobs += d.top_logprobs
        p = self.params
        comp = CompletionOutput(0, self.text, list(self.token_ids), list(self.logprobs) if p.logprobs else None,
                                d.finish_reason, list(self.top_logprobs) if p.top_logprobs else None)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), [comp], fin is not None, d.text,
                             d.token_ids, fin.prompt_logits if fin is not None else None, d.num_preemptions)
