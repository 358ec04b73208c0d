"""The types that cross between the front end and the engine core: the processed request going down,
the token-id deltas coming up, and the messages of the channel between `EngineCoreClient`
(core_client.py) and the core process (core_process.py). Types only: the core imports nothing else of
the front end.

The channel is two one-way pipes, each message pickled by hand (`send_bytes`: a tensor then travels
inline, not as a shared-memory handle):
- client -> core: AddRequest, AbortRequest, GrammarVocabulary (once, before the first request with a
  structured output), StopCore; the core drains every waiting message before each step.
- core -> client: CoreReady or CoreStartFailed first; then one StepOutputs per step (or per batch of
  requests handled while no step runs); CoreFailed as the last message when a step fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from ..config import SamplingParams

TopLogprobs = list[tuple[int, float]]   # per token: its top_logprobs most likely (id, logprob), best first


@dataclass
class ProcessedRequest:
    """A request the input processor accepted (input_processor.py): tokenized, every limit checked.
    Downstream trusts it and checks nothing again."""
    prompt: Optional[str]          # the text, when the prompt was text
    prompt_ids: list[int]
    params: "SamplingParams"
    # The tokenizer's end-of-sequence ids, which end the output unless params.ignore_eos: the core
    # has no tokenizer, so the front end names them.
    eos_ids: frozenset = frozenset()
    # params.structured_output compiled (xgrammar). Compiled grammars do not pickle, so a request
    # that crosses into the core process arrives without it and the core compiles it again there
    # (from xgrammar's cache when the schema repeats); in one process it is compiled once.
    grammar: Any = field(default=None, compare=False, repr=False)
    # (apiext) params.bad_words as token-id sequences (input_processor.py): the core has no tokenizer.
    bad_words_ids: tuple = ()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "grammar": None}


@dataclass(slots=True)
class OutputDelta:
    """What one core step added to one request: token ids, never text (slots: small to pickle, a list
    of them per step). The front end turns them into text (request_stream.py)."""
    request_id: str
    token_ids: list[int]                        # the new tokens
    logprobs: Optional[list[float]]             # theirs, when the request asked for logprobs
    top_logprobs: Optional[list[TopLogprobs]]   # theirs, when it asked for top_logprobs
    # Set on the request's last delta: "stop" (its last token is an end-of-sequence or stop token id),
    # "length" (max_tokens or max_model_len) or "abort".
    finish_reason: Optional[str]
    num_preemptions: int
    # [prompt_len, vocab] when asked for: on the delta of the first output token (the prompt is all
    # computed then), or on an abort that came before it.
    prompt_logits: Optional["torch.Tensor"] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def aborted(cls, request_id: str) -> "OutputDelta":
        """The only delta of a request that ends before it was ever scheduled."""
        return cls(request_id, [], None, None, "abort", 0)


@dataclass
class AddRequest:
    request_id: str
    request: ProcessedRequest


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class GrammarVocabulary:
    """The tokenizer's vocabulary as xgrammar describes it (TokenizerInfo.serialize_json): what the core,
    which has no tokenizer, compiles grammars against."""
    tokenizer_info: str


@dataclass
class StopCore:
    pass


@dataclass
class CoreInfo:
    """What the client learns of a core that started."""
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    worker_pids: list[int]     # the TP ranks the core spawned (the client ends them if the core dies)
    stats: dict                # EngineCore.stats() before the first step


@dataclass
class CoreReady:
    info: CoreInfo


@dataclass
class CoreStartFailed:
    message: str


@dataclass
class StepOutputs:
    deltas: list[OutputDelta]          # of every request the step advanced
    rejected: list[tuple[str, str]]    # (request id, why) of adds that failed in the core
    stats: dict                        # EngineCore.stats() after the step

    def __reduce__(self):
        # On the wire each delta is the tuple of its fields, rebuilt on arrival: pickle takes a slotted
        # dataclass about 4x as long as a tuple, and a step at batch 128 carries 128 deltas (on a CPU
        # here: 95 us to pickle such a step this way, 424 us as dataclasses).
        return (_step_outputs, ([_delta_fields(d) for d in self.deltas], self.rejected, self.stats))


_delta_fields = attrgetter(*(f.name for f in fields(OutputDelta)))


def _step_outputs(rows: list[tuple], rejected: list, stats: dict) -> StepOutputs:
    return StepOutputs([OutputDelta(*r) for r in rows], rejected, stats)


@dataclass
class CoreFailed:
    error: BaseException               # the step's exception (or a RuntimeError naming it, if it does not pickle)
