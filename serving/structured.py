"""Structured output: JSON grammars through xgrammar, one token bitmask per step for the whole batch.

A request's `StructuredOutput` is compiled once (xgrammar caches compiled grammars) into a matcher
that the sequence carries. Each step the engine asks `fill` for a bitmask [B, ceil(V/32)] of the
constrained rows, which the sampler applies on the device in one op; the host accepts each sampled
token into its matcher before the sequence's next mask is built (engine/llm_engine.py says how under async
scheduling). Once the JSON is complete the grammar allows only the end-of-sequence tokens, so the
output ends there.

Both kinds are compiled without free whitespace (compact JSON, `", "` and `": "` separators): a model
that may put whitespace anywhere can also put it there forever."""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import torch

from .config import StructuredOutput

# xgrammar's errors start with "[time] /path/to/file.cc:line: "; the rest is for the client.
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _clean_error(e: Exception) -> str:
    msg = str(e).strip()
    return _XGR_PREFIX.sub("", msg).strip() or type(e).__name__


class StructuredOutputs:
    """Grammar compiler and batch bitmask filler for one engine's tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._batch = None

    def _xgr(self):
        try:
            import xgrammar
        except ImportError as e:
            raise ValueError("structured output needs the xgrammar package (pip install 'tp-overlap[serve]')") from e
        return xgrammar

    @property
    def compiler(self):
        # Compiled on the server's thread, filled on the engine loop's: the filler exists before any
        # caller can see the compiler (and so before any matcher exists).
        if self._compiler is None:
            xgr = self._xgr()
            info = self._tokenizer_info(xgr)
            self._batch = xgr.BatchGrammarMatcher()   # threads: half the cores
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def _tokenizer_info(self, xgr):
        if self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model has none")
        hf = getattr(self.tokenizer, "hf_tokenizer", None)
        if hf is not None:
            return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
        vocab = getattr(self.tokenizer, "encoded_vocab", None)
        if vocab is None:
            raise ValueError(f"structured output is not supported with {type(self.tokenizer).__name__}")
        # Token strings as raw bytes; "" marks a special token, which no grammar ever allows (its
        # text is not what it decodes to); ids past the tokenizer's vocabulary are special too.
        return xgr.TokenizerInfo(vocab(), xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_token_ids)

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar; ValueError naming the problem when the schema is not usable."""
        compiler = self.compiler
        try:
            if so.json_object:
                return compiler.compile_json_schema({"type": "object"}, any_whitespace=False)
            return compiler.compile_json_schema(json.dumps(so.json_schema), any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"the JSON schema cannot be used: {_clean_error(e)}") from None

    def matcher(self, compiled) -> Any:
        return self._xgr().GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)

    def fill(self, matchers: Sequence[Any], rows: Sequence[int], batch_size: int,
             device: torch.device) -> torch.Tensor:
        """The bitmask [batch_size, ceil(V/32)] on `device`: rows[i] from matchers[i], other rows all
        ones. A fresh host tensor each step, so that no copy still in flight reads a row being refilled."""
        xgr = self._xgr()
        mask = xgr.allocate_token_bitmask(batch_size, self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(list(matchers), mask, indices=list(rows))
        return mask.to(device)

