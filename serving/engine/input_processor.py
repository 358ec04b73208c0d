"""Input processing: every check of a request that needs no engine state, and its tokenization, once.

The front end runs it (front_end.py: `LLMEngine.add_request`, `AsyncLLM.process_request` / `generate`,
the HTTP server through `AsyncLLM`) and hands the `ProcessedRequest` on; the engine core trusts it. Bad
input fails here, before a stream starts and before anything reaches the core process.
"""

from __future__ import annotations

from typing import Optional, Union

from ..config import ContextLengthError, EngineConfig, RequestError, SamplingParams, resolve_model_dir
from .structured import StructuredOutputs
from ..model.tokenizer import ByteTokenizer, load_tokenizer
from .messages import ProcessedRequest

Prompt = Union[str, list[int]]


def engine_tokenizer(cfg: EngineConfig, mcfg) -> tuple:
    """(tokenizer or None, end-of-sequence ids) of an engine's model: the engine and the process that
    processes its requests load the same one."""
    tokenizer = load_tokenizer(resolve_model_dir(cfg.model, weights=False), cfg.tokenizer)
    eos_ids = set(mcfg.eos_token_ids)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos_ids.add(tokenizer.eos_token_id)
    elif tokenizer is None and cfg.effective_load_format() == "dummy":
        # A shipped config benchmarked with dummy weights has no tokenizer files: the byte
        # tokenizer stands in (its ids past 255 show as placeholders), so text and streams work
        # as with a real model. Its end-of-sequence id is not the model's and is not used.
        tokenizer = ByteTokenizer()
    return tokenizer, eos_ids


class InputProcessor:
    """Turns (prompt, sampling params) into a ProcessedRequest, or an error that names the limit."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, structured: StructuredOutputs,
                 eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)   # stamped on each request: the core has no tokenizer to ask
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured = structured

    def process(self, prompt: Prompt, params: Optional[Union[SamplingParams, dict]] = None) -> ProcessedRequest:
        """ValueError, TypeError or RequestError (a sampling parameter) naming what is wrong."""
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams or dict, not {type(params).__name__}")
        text: Optional[str] = None
        if isinstance(prompt, str):
            text = prompt
            ids = self.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError("a prompt is a string or a list of token ids")
        if not ids:
            raise ValueError("the prompt is empty; at least one token is required")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        self.check_context(len(ids))
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        bad = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               "logit_bias")
        bad = [t for t in params.allowed_token_ids or () if t >= self.vocab_size]
        if bad:
            raise RequestError(f"allowed_token_ids has {bad[0]}, outside the vocabulary [0, {self.vocab_size})",
                               "allowed_token_ids")
        grammar = None
        if params.structured_output is not None:
            grammar = self.compile_grammar(params)
        return ProcessedRequest(text, ids, params, frozenset(self.eos_ids), grammar,
                                self.bad_words_ids(params.bad_words))

    def bad_words_ids(self, words: list[str]) -> tuple:
        """(apiext) vLLM's bad_words as token-id sequences: each word (leading spaces stripped) as it
        tokenizes at the start of a text, and, where a tokenizer folds a space into a word's first token
        (BPE's "Ġword"), as it tokenizes after a space."""
        if not words:
            return ()
        if self.tokenizer is None:
            raise RequestError("bad_words need a tokenizer; this model has none (use logit_bias)", "bad_words")
        out: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(self.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                raise RequestError(f"bad_words: {word!r} has no tokens", "bad_words")
            spaced = tuple(self.encode(" " + word.lstrip(), add_special_tokens=False))
            for seq in (plain, spaced) if len(spaced) == len(plain) and spaced[0] != plain[0] else (plain,):
                if seq not in out:
                    out.append(seq)
        return tuple(out)

    def check_context(self, n_prompt: int, max_tokens: Optional[int] = None, param: str = "max_tokens",
                      prompt_param: str = "prompt") -> None:
        """ContextLengthError naming what to change when a prompt of `n_prompt` tokens and `max_tokens`
        (None: the reply may fill what is left, at least one token) do not fit max_model_len: the prompt
        (`prompt_param`) when it alone leaves no room, else either (`param` is max_tokens' name)."""
        limit = self.max_model_len
        if n_prompt >= limit and max_tokens is None:
            raise ContextLengthError(f"{n_prompt} prompt tokens but max_model_len is {limit}: no room is left for a "
                                     f"reply; shorten the {prompt_param} to at most {limit - 1} tokens", prompt_param)
        if n_prompt >= limit:
            raise ContextLengthError(f"{n_prompt} prompt tokens leave no room for a reply in this model's context of "
                                     f"{limit} tokens (max_model_len), and the request asks for {n_prompt} prompt "
                                     f"tokens + {param}={max_tokens}; shorten the {prompt_param} to at most "
                                     f"{max(limit - max_tokens, 1)} tokens", prompt_param)
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise ContextLengthError(f"this model's context is {limit} tokens (max_model_len) but the request needs "
                                     f"{n_prompt + max_tokens}: {n_prompt} prompt tokens + {param}={max_tokens}; "
                                     f"shorten the prompt or lower {param}", param)

    # ---- tokenization: the one place text becomes ids (the server's handlers call these too) ----------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; ValueError when the model has no tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; send the prompt as token ids")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)) if text else []

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True,
                  tools: Optional[list[dict]] = None, continue_final_message: bool = False,
                  chat_template: Optional[str] = None, **template_kwargs) -> str:
        """The messages (and the tools offered, if any) through the model's chat template; ValueError when
        the model has no tokenizer (so no template) or the template rejects them (the message says which).
        (apiext) vLLM's continue_final_message leaves the last message open; template_kwargs are template
        variables, chat_template a request's own Jinja template."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template; send token ids to the "
                             "completions API")
        try:
            from jinja2 import TemplateError
        except ImportError:   # (then there are no Hugging Face templates either)
            TemplateError = ValueError
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tools=tools, continue_final_message=continue_final_message,
                                                      chat_template=chat_template, **template_kwargs)
        except (ValueError, TypeError, TemplateError) as e:
            # (A template's own `raise_exception`, e.g. "only one tool call at a time", is a TemplateError.)
            raise ValueError(f"the chat template rejected the messages: {e}") from None

    def encode_chat(self, text: str) -> list[int]:
        """The ids of a rendered chat. Templates usually write the BOS token themselves, and encoding
        with special tokens would add a second: the tokenizer's own prefix is kept only when the
        template did not write it."""
        with_special = self.encode(text)
        plain = self.encode(text, add_special_tokens=False)
        prefix = with_special[:len(with_special) - len(plain)]
        if prefix and plain[:len(prefix)] == prefix:
            return plain
        return with_special

    def compile_grammar(self, params: SamplingParams):
        """The compiled grammar of params.structured_output; RequestError naming the problem."""
        try:
            return self.structured.compile(params.structured_output)
        except ValueError as e:
            raise RequestError(str(e), "structured_output") from None
