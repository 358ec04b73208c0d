"""The types that cross between the request side and the engine core: the processed request, and the
messages of the channel between `EngineCoreClient` (core_client.py) and the core process
(core_process.py). Types only: the core imports nothing else of the request side.

The channel is two one-way pipes, each message pickled by hand (`send_bytes`: a tensor then travels
inline, not as a shared-memory handle):
- client -> core: AddRequest, AbortRequest, StopCore; the core drains every waiting message before
  each step.
- core -> client: CoreReady or CoreStartFailed first; then one StepOutputs per step (or per batch of
  requests handled while no step runs); CoreFailed as the last message when a step fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Optional

from .outputs import OutputDelta

if TYPE_CHECKING:
    from ..config import SamplingParams


@dataclass
class ProcessedRequest:
    """A request the input processor accepted (input_processor.py): tokenized, every limit checked.
    Downstream trusts it and checks nothing again."""
    prompt: Optional[str]          # the text, when the prompt was text
    prompt_ids: list[int]
    params: "SamplingParams"
    # params.structured_output compiled (xgrammar). Compiled grammars do not pickle, so a request
    # that crosses into the core process arrives without it and the core compiles it again there
    # (from xgrammar's cache when the schema repeats); in one process it is compiled once.
    grammar: Any = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "grammar": None}


@dataclass
class AddRequest:
    request_id: str
    request: ProcessedRequest


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class StopCore:
    pass


@dataclass
class CoreInfo:
    """What the client learns of a core that started."""
    max_model_len: int
    vocab_size: int
    eos_ids: list[int]
    num_blocks: int
    block_size: int
    worker_pids: list[int]     # the TP ranks the core spawned (the client ends them if the core dies)
    stats: dict                # LLMEngine.stats() before the first step


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
    stats: dict                        # LLMEngine.stats() after the step

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
