"""`FrontEnd`: the request side that `LLMEngine` (offline, in this process) and `AsyncLLM` (streams, over
a core process) share. It owns everything that needs the tokenizer: input processing (validate and
tokenize once, input_processor.py) and one `RequestStream` per request (detokenizing, stop strings,
request_stream.py). The engine core below it sees token ids only.
"""

from __future__ import annotations

from typing import Optional, Union

from ..config import EngineConfig, SamplingParams
from .input_processor import InputProcessor, Prompt, engine_tokenizer
from .messages import ProcessedRequest
from .request_stream import RequestStream
from .structured import StructuredOutputs


class FrontEnd:
    """The model's tokenizer and end-of-sequence ids, the input processor over them, and the streams."""

    def __init__(self, tokenizer, eos_ids: set[int], vocab_size: int, max_model_len: int):
        """`tokenizer` and `eos_ids` as `load` returns them."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, eos_ids)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, max_model_len, self.structured,
                                              eos_ids)

    @staticmethod
    def load(cfg: EngineConfig, mcfg) -> tuple:
        """(tokenizer or None, end-of-sequence ids) of the model (input_processor.engine_tokenizer)."""
        return engine_tokenizer(cfg, mcfg)

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
