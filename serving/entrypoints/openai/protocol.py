"""Request and response schemas of the OpenAI-compatible server.

The request models list the fields the engine honours, and those it cannot honour: a client that sends
`functions` or asks for `audio` gets a 400 that names the field, instead of an answer that quietly differs
from what it asked for. Fields that clients send with their neutral defaults (`suffix: null`, `audio: null`,
`priority: 0`, ...) are accepted at those values only; fields that SDKs and agent frameworks send and that
change nothing here (`store`, `metadata`, `reasoning_effort`, ...) are accepted and ignored
(ChatCompletionRequest.IGNORED); a field no model lists is ignored and logged once by name, as vLLM ignores
it (protocol_base.py). vLLM's request extensions are honoured: guided decoding, min_tokens, request_id,
truncate_prompt_tokens, bad_words, allowed_token_ids, ... (protocol_vllm.py, protocol_vllm_fields.py),
`best_of` of n or more (the n likeliest of best_of are returned), add_special_tokens, chat's echo /
continue_final_message / chat_template / chat_template_kwargs / documents.

Strict mode: `"max_tokens": "10"` or `"prompt": [true]` are type errors, as in the OpenAI API.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from ...config import (MAX_LOGIT_BIAS, MinP, Penalty, RepetitionPenalty, Temperature, TopLogprobs,
                       TopP)
from .chat_messages import (MAX_TOOLS, ChatMessage, ChatTool, DeltaToolCall, ToolCall, ToolChoice,
                            TextContentPart, null_only)
from .protocol_base import RequestModel as _Request
from .protocol_base import schema_iff_json_schema, stream_options_need_stream
from .protocol_base import ResponseModel as _Response
from .protocol_vllm import PromptLogprobs, VllmExtensions

# Stop strings are matched against the tail of the text after every token; a bound keeps that cheap.
MAX_STOP_STRINGS = 16
# OpenAI allows 300 logit_bias entries per request.
MAX_LOGIT_BIAS_ENTRIES = 300


# ---- errors -----------------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ---- shared request pieces -------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: Optional[bool] = Field(False, description="null: false")
    include_obfuscation: Optional[bool] = Field(None, description="accepted and ignored: chunks carry no padding")
    continuous_usage_stats: Optional[bool] = Field(False, description="vLLM's: with include_usage, usage on every "
                                                   "chunk too; null: false")


class JsonSchemaFormat(_Request):
    name: Optional[str] = Field(None, description="accepted for OpenAI compatibility, not used")
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema",
                                              description="the JSON schema; absent: any JSON object")
    strict: Optional[bool] = Field(None, description="accepted; the output always follows the schema")


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        schema_iff_json_schema(self.type, self.json_schema, "json_schema",
                               "response_format of type 'json_schema' needs a 'json_schema' object")
        return self

    def structured_output(self) -> Optional[dict[str, Any]]:
        """The engine's StructuredOutput fields, or None for plain text."""
        if self.type == "json_object" or (self.type == "json_schema" and self.json_schema.schema_ is None):
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json_schema": self.json_schema.schema_}
        return None


class _SamplingFields(VllmExtensions):
    """The sampling knobs common to both endpoints (OpenAI's plus vLLM's extensions)."""

    model: Optional[str] = Field(None, description="the served model name; default: the one model served")
    temperature: Optional[Annotated[Temperature, Field(le=2.0)]] = Field(None, description="0 is greedy; default 1")
    top_p: Optional[TopP] = None
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0 disables")
    min_p: Optional[MinP] = None
    n: Optional[int] = Field(1, ge=1, le=128, description="completions per prompt; null: 1")
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)
    ignore_eos: bool = False
    stream: Optional[bool] = Field(False, description="null: false")
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, description="an end-user id; recorded in nothing, accepted for compatibility")
    presence_penalty: Optional[Penalty] = Field(None, description="subtracted from the logit of each token "
                                                "generated so far")
    frequency_penalty: Optional[Penalty] = Field(None, description="subtracted from a token's logit once per time it "
                                                 "was generated so far")
    repetition_penalty: Optional[RepetitionPenalty] = Field(None, description="vLLM's: divides positive and "
                                                            "multiplies negative logits of prompt and output tokens; "
                                                            "1 disables")
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id (as a string) -> bias added to its "
                                                   f"logit, in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    response_format: Optional[ResponseFormat] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
        return v

    @field_validator("n")
    @classmethod
    def _null_n(cls, v):
        return 1 if v is None else v   # (OpenAI's SDK types allow null, meaning the default)

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v):
        if v and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries are supported, got {len(v)}")
        for k, b in v.items():
            if not (k.isascii() and k.isdigit()):
                raise ValueError(f"logit_bias keys are token ids written as strings of digits, not {k!r}")
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:   # (also rejects NaN)
                raise ValueError(f"the bias of token {k} is {b}; it must be in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        return stream_options_need_stream(self)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's SamplingParams, except max_tokens / logprobs / seed."""
        kw: dict[str, Any] = dict(stop=self.stop_list(), stop_token_ids=list(self.stop_token_ids or []),
                                  ignore_eos=self.ignore_eos,
                                  include_stop_str_in_output=self.include_stop_str_in_output)
        if self.temperature is not None:
            kw["temperature"] = self.temperature
        if self.top_p is not None:
            kw["top_p"] = self.top_p
        if self.top_k is not None:
            kw["top_k"] = max(self.top_k, 0)
        if self.min_p is not None:
            kw["min_p"] = self.min_p
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.logit_bias:
            kw["logit_bias"] = {int(k): b for k, b in self.logit_bias.items()}
        if self.response_format is not None and self.response_format.structured_output() is not None:
            kw["structured_output"] = self.response_format.structured_output()
        if self.extension_structured_output() is not None:
            kw["structured_output"] = self.extension_structured_output()
        kw.update(min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                  **self.vllm_sampling_kwargs())
        return kw

    def structured_param(self) -> str:
        """The field a structured-output error names: the one the client used."""
        kinds = self.structured_kinds()
        return kinds[0] if kinds else "response_format"


# ---- /v1/completions --------------------------------------------------------------------------------
Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt = Field(..., description="a string, a list of strings, token ids, or a list of token-id lists")
    max_tokens: Optional[int] = Field(16, ge=1, description="tokens to generate per choice; null: what is left "
                                                            "of the context")
    logprobs: Optional[TopLogprobs] = Field(None, description="the sampled token's log-probability and this many "
                                            "most likely tokens' at each position (raw model distribution)")
    echo: Optional[bool] = Field(False, description="null: false")
    add_special_tokens: Optional[bool] = Field(True, description="the tokenizer's special tokens (e.g. BOS) "
                                               "around a text prompt; null: true")
    prompt_embeds: null_only("prompt embeddings are not supported; send text or token ids") = None
    best_of: Optional[int] = Field(None, ge=1, le=128, description="generate this many per prompt and return the "
                                   "n with the highest cumulative log-probability (not with stream)")
    suffix: Optional[str] = Field(None, description="not supported; only null is accepted")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, v, handler):
        # One message instead of pydantic's four (one per union branch).
        try:
            return handler(v)
        except ValidationError:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids (integers) "
                             "or a list of token-id lists") from None

    @field_validator("prompt")
    @classmethod
    def _prompt_nonempty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt is an empty list; at least one prompt or token id is required")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v is not None:
            raise ValueError("suffix (insertion) is not supported by this server")
        return v

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of} is less than n={self.n}; it must be at least n")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of greater than n cannot stream: the best are known once all are finished")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is only supported without streaming")
        if self.echo and self.logprobs is not None and self.stream:
            raise ValueError("echo with logprobs is only supported without streaming (the prompt's "
                             "log-probabilities are known once the request is finished)")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


# vLLM's stop_reason: the stop string that matched, the stop token id that was generated, or null (the
# end-of-sequence token, length, abort).
StopReason = Annotated[Optional[Union[int, str]], Field(description="the matched stop string or stop token id; "
                                                                    "null otherwise")]


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length", "abort"]] = None
    stop_reason: StopReason = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: Union[str, dict]) -> str:
    """One server-sent event: a chunk (a dict, as JSON) or the closing `[DONE]`."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length", "abort"]] = None
    stop_reason: StopReason = None


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ---- /v1/chat/completions ---------------------------------------------------------------------------
# The messages and tools: chat_messages.py.
class Prediction(_Request):
    type: Literal["content"]
    content: Union[str, list[TextContentPart]]


class PromptCacheOptions(_Request):
    mode: Optional[Literal["implicit", "explicit"]] = None
    ttl: Optional[Literal["30m"]] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, description="default: what is left of the context")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="the newer name of max_tokens")
    logprobs: Optional[bool] = Field(False, description="null: false")
    top_logprobs: Optional[TopLogprobs] = Field(None, description="this many most likely tokens at each position "
                                                "(needs logprobs)")
    add_generation_prompt: bool = True
    # ---- tools (chat_tools.py says what each tool_choice does) ----
    tools: Optional[list[ChatTool]] = Field(None, max_length=MAX_TOOLS,
                                            description="function tools; rendered by the model's chat template")
    tool_choice: Optional[ToolChoice] = Field(
        None, description="'none', 'auto' (needs --enable-auto-tool-choice), 'required', a named function, or "
                          "allowed_tools; default: 'auto' when tools are given, else 'none'")
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one tool call per reply")
    # ---- vLLM's chat extensions ----
    echo: bool = Field(False, description="the reply starts with the last message's content when that message "
                                          "has the reply's role")
    continue_final_message: bool = Field(False, description="the last message is left open and the reply "
                                                            "continues it (needs add_generation_prompt=false)")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="extra variables for the chat template")
    chat_template: Optional[str] = Field(None, min_length=1, description="a Jinja chat template for this request "
                                         "(needs --trust-request-chat-template, as in vLLM)")
    documents: Optional[list[dict[str, str]]] = Field(None, description="the chat template's `documents` (RAG); "
                                                      "templates that do not use them ignore them")
    add_special_tokens: Optional[bool] = Field(
        None, description="true: the tokenizer's special tokens (e.g. BOS) on top of the template's text; false: "
                          "the template's text alone; null: the tokenizer's prefix only where the template did "
                          "not write it")
    include_reasoning: Optional[bool] = Field(None, description="accepted: no reasoning parser runs here, so the "
                                              "reply is never split into reasoning and content")
    # ---- fields that OpenAI's SDKs and agent frameworks send and that change nothing here: accepted,
    # logged at debug level (IGNORED), and otherwise ignored ----
    store: Optional[bool] = Field(None, description="ignored: this server keeps no completions")
    metadata: Optional[dict[str, str]] = Field(None, description="ignored: kept only with stored completions")
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority", "fast"]] = Field(
        None, description="ignored: one tier")
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = Field(
        None, description="ignored: the models served here answer without a reasoning phase")
    verbosity: Optional[Literal["low", "medium", "high"]] = Field(
        None, description="ignored: the reply is as long as the model makes it")
    prompt_cache_key: Optional[str] = Field(None, description="ignored: prefix caching needs no key")
    prompt_cache_options: Optional[PromptCacheOptions] = Field(None, description="ignored: prefix caching is automatic")
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = Field(
        None, description="ignored: prefix caching is automatic")
    safety_identifier: Optional[str] = Field(None, description="ignored: recorded nowhere")
    prediction: Optional[Prediction] = Field(
        None, description="ignored: a predicted output only saves time elsewhere; the reply is the same without it")
    IGNORED: ClassVar[tuple[str, ...]] = ("store", "metadata", "service_tier", "reasoning_effort", "verbosity",
                                          "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
                                          "safety_identifier", "prediction")
    # ---- accepted only as null (or a neutral value): any other asks for what this server does not do ----
    audio: null_only("this server produces no audio") = None
    modalities: Optional[list[Literal["text"]]] = Field(None, description="only 'text': no audio is produced")
    web_search_options: null_only("this server searches nothing") = None
    moderation: null_only("this server runs no moderation") = None
    functions: null_only("the deprecated 'functions' are not supported; send them as 'tools'") = None
    function_call: Optional[Literal["none", "auto"]] = Field(
        None, description="deprecated; without 'functions' both values mean no call")

    @field_validator("tool_choice", "function_call", mode="before")
    @classmethod
    def _known_choice(cls, v, info: ValidationInfo):
        # One clear line instead of pydantic's one error per union branch.
        if info.field_name == "function_call":
            if isinstance(v, dict):
                raise ValueError("a named function_call (deprecated) is not supported; send 'tools' and 'tool_choice'")
            return v
        if v is not None and not isinstance(v, (str, dict)) or isinstance(v, str) and v not in ("none", "auto",
                                                                                                 "required"):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or an object, not {v!r}")
        if isinstance(v, dict) and v.get("type") not in ("function", "allowed_tools"):
            raise ValueError(f"tool_choice of type {v.get('type')!r} is not supported; send 'none', 'auto', "
                             f"'required', a function ({{\"type\": \"function\", \"function\": {{\"name\": ...}}}}) "
                             f"or allowed_tools")
        return v

    @field_validator("modalities", mode="before")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list) and any(m != "text" for m in v):
            raise ValueError(f"only the 'text' modality is supported, not {[m for m in v if m != 'text']}")
        return v

    def ignored_fields(self) -> dict[str, Any]:
        """The fields of IGNORED that the client set."""
        return {k: getattr(self, k) for k in self.IGNORED if getattr(self, k) is not None}

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return v

    @model_validator(mode="after")
    def _one_max(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=false: a reply either starts "
                             "a new message or continues the last one")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is only supported without streaming")
        return self

    def reply_role(self) -> str:
        """vLLM's rule: a new assistant message, or (no generation prompt) more of the last message's role."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].for_template()["role"]

    def echoed(self) -> str:
        """What `echo` puts before the reply: the last message's text when its role is the reply's."""
        last = self.messages[-1].for_template()
        return last["content"] if self.echo and last["role"] == self.reply_role() else ""

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = Field(..., description="null when the reply is only tool calls")
    tool_calls: Optional[list[ToolCall]] = None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: Optional[list[ChatTokenLogprob]] = None


# why a chat reply ended: a completion's reasons, and a reply that is tool calls
ChatFinishReason = Literal["stop", "length", "tool_calls", "abort"]


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[ChatFinishReason] = None
    stop_reason: StopReason = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[PromptLogprobs] = None


class DeltaMessage(_Response):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[ChatFinishReason] = None
    stop_reason: StopReason = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ---- /v1/models, /version ---------------------------------------------------------------------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tp-overlap"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(_Response):
    version: str


# ---- /tokenize, /detokenize (vLLM's request and response shapes) -------------------------------------
class TokenizeRequest(_Request):
    """A prompt, or chat messages rendered through the model's chat template; exactly one of them."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    tools: Optional[list[ChatTool]] = Field(None, max_length=MAX_TOOLS, description="messages only: rendered by "
                                            "the chat template, as /v1/chat/completions does")
    add_generation_prompt: bool = Field(True, description="messages only")
    continue_final_message: bool = Field(False, description="messages only: as /v1/chat/completions takes it")
    chat_template: Optional[str] = Field(None, min_length=1, description="messages only: as /v1/chat/completions "
                                                                        "takes it")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="messages only")
    add_special_tokens: Optional[bool] = Field(
        None, description="default: true for a prompt; for messages, the ids /v1/chat/completions would use")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        if self.tools is not None and self.messages is None:
            raise ValueError("'tools' go with 'messages' (the chat template renders them), not with a prompt")
        if self.prompt is not None:
            for name in ("continue_final_message", "chat_template", "chat_template_kwargs"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"unsupported parameter '{name}' with a prompt: it goes with 'messages' "
                                     f"(the chat template)")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=false: a reply either starts "
                             "a new message or continues the last one")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str
