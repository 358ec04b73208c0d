"""vLLM's remaining request fields (both endpoints), so that a client sending whole vLLM request objects
gets what `vllm serve` gives it:

- honoured: truncate_prompt_tokens, bad_words, allowed_token_ids, return_tokens_as_token_ids, cache_salt
  (the prefix cache never shares blocks across salts), guided_decoding_backend ('xgrammar' is what
  compiles every grammar here);
- accepted, changing nothing here, as in vLLM: spaces_between_special_tokens (vLLM applies it only with
  slow tokenizers; this engine detokenizes as its fast ones do), length_penalty (beam search only),
  kv_transfer_params, vllm_xargs, mm_processor_kwargs (no connector, extension or multimodal processor
  reads them);
- accepted at their neutral value only, any other a 400 naming the field and why: priority (0; the
  scheduler is first come, first served, which vLLM too answers with an error), use_beam_search,
  logits_processors, return_token_ids, guided_whitespace_pattern, structural_tag, and the repetition-
  pattern stop (max/min_repetition_pattern_size, repetition_min_count).

The endpoint-specific ones (add_special_tokens' defaults, chat's chat_template / documents) are in
protocol.py beside their endpoint. serving/README.md lists them all."""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import BeforeValidator, Field, WithJsonSchema, field_validator

from .protocol_base import RequestModel

# bad_words are matched against the output after every token; a bound keeps that cheap.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
# allowed_token_ids: at most a vocabulary's worth.
MAX_ALLOWED_TOKEN_IDS = 1 << 20
# The backends vLLM names that compile grammars with xgrammar, which is this server's only compiler.
XGRAMMAR_BACKENDS = ("auto", "xgrammar")


def neutral_only(neutral: tuple, why: str, annotation: Any = Any):
    """A field accepted only at its neutral values (null among them): any other is a 400 saying `why`."""
    shown = " or ".join(["null"] + [repr(v).lower() if isinstance(v, bool) else repr(v) for v in neutral])

    def check(v):
        if v is not None and not any(v == n and type(v) is type(n) for n in neutral):
            raise ValueError(f"{why} (only {shown} is accepted)")
        return v

    # The schema says it too: OpenAPI clients (and the fuzz tests) see the values that pass.
    schema = WithJsonSchema({"enum": [None, *neutral], "description": f"only {shown}: {why}"})
    return Annotated[Optional[annotation], BeforeValidator(check), schema]


def ignored(description: str, annotation: Any = Any):
    return Annotated[Optional[annotation], Field(description=f"accepted, changes nothing here: {description}")]


class VllmRequestFields(RequestModel):
    """vLLM's request fields of issue 54 (module docstring), shared by both endpoints."""

    # ---- honoured ----
    truncate_prompt_tokens: Optional[Annotated[int, WithJsonSchema(
        {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1}]})]] = Field(
        None, ge=-1, description="keep only the prompt's last this many tokens; -1: the model's context "
                                 "(max_model_len); usage.prompt_tokens counts what is kept")
    bad_words: Optional[list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]]] = Field(
        None, max_length=MAX_BAD_WORDS, description="words the output never contains as tokens (each word as "
                                                    "written and after a space, as vLLM tokenizes it)")
    allowed_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS, description="only these tokens can be generated")
    return_tokens_as_token_ids: Optional[bool] = Field(
        None, description="with logprobs: tokens are written 'token_id:<id>'")
    cache_salt: Optional[str] = Field(
        None, min_length=1, description="prefix-cache blocks are shared only among requests with the same salt")
    guided_decoding_backend: Optional[str] = Field(
        None, json_schema_extra={"pattern": "^(auto|xgrammar)(:.*)?$"}, description="'auto' or 'xgrammar' (with options after a colon): grammars are compiled by xgrammar")
    # ---- accepted, changing nothing here (as in vLLM) ----
    spaces_between_special_tokens: Optional[bool] = Field(
        None, description="accepted: vLLM applies it only with slow tokenizers; text is detokenized here as "
                          "vLLM does with fast ones (no spaces added around special tokens)")
    length_penalty: ignored("it weighs beam search's scores, and there is no beam search", float) = None
    kv_transfer_params: ignored("no KV connector (disaggregated serving)", dict[str, Any]) = None
    vllm_xargs: ignored("no extension reads them", dict[str, Any]) = None
    mm_processor_kwargs: ignored("no multimodal processor (text-only models)", dict[str, Any]) = None
    # ---- neutral only ----
    priority: neutral_only((0,), "priority scheduling is not enabled: this server's scheduler serves requests "
                                 "first come, first served", int) = None
    use_beam_search: neutral_only((False,), "beam search is not implemented", bool) = None
    logits_processors: neutral_only(([],), "this server loads no logits processors", list) = None
    return_token_ids: neutral_only((False,), "the token ids are not returned; /tokenize gives a prompt's ids",
                                   bool) = None
    guided_whitespace_pattern: neutral_only((), "JSON is generated compact here (xgrammar without free "
                                                "whitespace); a whitespace pattern cannot be applied", str) = None
    structural_tag: neutral_only((), "structural tags are not supported", str) = None
    max_repetition_pattern_size: neutral_only((0,), "stopping on repeated patterns is not implemented", int) = None
    min_repetition_pattern_size: neutral_only((0,), "stopping on repeated patterns is not implemented", int) = None
    repetition_min_count: neutral_only((0,), "stopping on repeated patterns is not implemented", int) = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, v):
        if v == 0:
            raise ValueError("truncate_prompt_tokens=0 would leave no prompt; send -1 (the model's context) or "
                             "a count of at least 1")
        return v

    @field_validator("guided_decoding_backend")
    @classmethod
    def _xgrammar(cls, v):
        if v is not None and v.split(":", 1)[0] not in XGRAMMAR_BACKENDS:
            raise ValueError(f"grammars are compiled by xgrammar on this server, not {v!r}; send 'auto', "
                             f"'xgrammar' or nothing")
        return v

    def vllm_sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams' fields from these: bad_words, allowed_token_ids, cache_salt."""
        kw: dict[str, Any] = {}
        if self.bad_words:
            kw["bad_words"] = list(self.bad_words)
        if self.allowed_token_ids is not None:
            kw["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.cache_salt is not None:
            kw["cache_salt"] = self.cache_salt
        return kw


def truncated(ids: list[int], keep: Optional[int], max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` ids (-1: max_model_len); ValueError past the context."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} is more than this model's context of {max_model_len} "
                         f"tokens (max_model_len); send at most {max_model_len}, or -1 for that")
    return ids[-keep:]

