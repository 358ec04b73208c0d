"""What a caller reads: `RequestOutput` (one per request per step while it streams, the last one whole)
and its `CompletionOutput`. The front end's `RequestStream` (request_stream.py) builds them from the
core's token-id deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from .messages import TopLogprobs

if TYPE_CHECKING:
    import torch


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[float]]
    finish_reason: Optional[str]   # "stop" | "length" | "abort" | None while running
    # per token, its top_logprobs most likely (id, logprob), best first, when asked for
    top_logprobs: Optional[list[TopLogprobs]] = None
    # vLLM's: the stop string that matched or the stop token id that ended it; None otherwise
    # (end-of-sequence, length, abort)
    stop_reason: Union[int, str, None] = None


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
