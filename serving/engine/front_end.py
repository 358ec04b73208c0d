"""`FrontEnd`: the request side that `LLMEngine` (offline, in this process) and `AsyncLLM` (streams, over
a core process) share. It owns everything that needs the tokenizer: input processing (validate and
tokenize once, input_processor.py) and one `RequestStream` per request (detokenizing, stop strings,
request_stream.py). The engine core below it sees token ids only.
"""

from __future__ import annotations

from typing import Optional, Union

from ..config import EngineConfig, SamplingParams
from ..structured import StructuredOutputs
from .input_processor import InputProcessor, Prompt, engine_tokenizer
from .messages import ProcessedRequest
from .request_stream import RequestStream


class FrontEnd:
    """The model's tokenizer and end-of-sequence ids, the input processor over them, and the streams."""

    def __init__(self, cfg: EngineConfig, mcfg, max_model_len: int):
        self.tokenizer, eos_ids = engine_tokenizer(cfg, mcfg)
        self.vocab_size: int = mcfg.vocab_size
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, eos_ids)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, max_model_len, self.structured,
                                              eos_ids)

    @property
    def eos_ids(self) -> set[int]:
        return self.input_processor.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        """The ids every request stops on from now on (tests pretend a token is the EOS)."""
        self.input_processor.eos_ids = set(ids)

    def process(self, prompt: Prompt, params: Optional[Union[SamplingParams, dict]] = None) -> ProcessedRequest:
        return self.input_processor.process(prompt, params)

    def stream(self, request_id: str, request: ProcessedRequest) -> RequestStream:
        return RequestStream(request_id, request, self.tokenizer)

    def grammar_vocabulary(self) -> str:
        """The tokenizer's vocabulary for the core's grammar compiler (messages.GrammarVocabulary)."""
        return self.structured.vocabulary_json()
