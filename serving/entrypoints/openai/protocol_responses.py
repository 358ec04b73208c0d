"""Request and response schemas of POST /v1/responses (OpenAI's Responses API), as the `openai` SDK's
`client.responses.create` sends and reads them.

The request is served by the chat path (serving_responses.py): `input` (a string, or a list of message,
function_call and function_call_output items) and `instructions` become chat messages, the function
`tools` and `tool_choice` chat's tools, `text.format` chat's response_format; `to_chat()` builds that
ChatCompletionRequest. Like the other routes, what the engine cannot honour is refused naming the field
(image or file input, hosted tools such as web_search, background runs, logprobs); what changes nothing
here (`reasoning`, `user`, `prompt_cache_key`, ...) is accepted and ignored.

The response lists the output items (`message` with `output_text` parts, `function_call`) and the
request's settings as OpenAI echoes them.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AliasChoices, Discriminator, Field, Tag, field_validator, model_validator

from ...config import MinP, Penalty, RepetitionPenalty, Temperature, TopP
from .chat_messages import FUNCTION_NAME_PATTERN, MAX_TOOLS, PromptCacheBreakpoint, null_only
from .protocol import MAX_STOP_STRINGS
from .protocol_base import RequestModel as _Request
from .protocol_base import schema_iff_json_schema, stream_options_need_stream
from .protocol_base import ResponseModel as _Response
from .protocol_vllm import MAX_REQUEST_ID_CHARS

ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text", "refusal")
# The discriminator values pydantic puts into an error's location after an item's index; a client wants
# `input.0.content`, not `input.0.message.content` (server_errors.py drops them).
ITEM_TAGS = frozenset(ITEM_TYPES + PART_TYPES)


def _check_types(v: Any, allowed: tuple[str, ...], what: str, default: Optional[str] = None) -> Any:
    """A list of items tagged by `type`, checked before pydantic's union: one clear line for an unsupported
    type (instead of an error per union branch). `default`: the type of an item without one."""
    for i, item in enumerate(v if isinstance(v, list) else ()):
        kind = item.get("type", default) if isinstance(item, dict) else None
        if isinstance(item, dict) and kind not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            raise ValueError(f"{what}[{i}] is of type {kind!r}, which this server does not support; only {shown}")
    return v


def _only_types(allowed: tuple[str, ...], what: str):
    """_check_types as a before-validator."""
    return classmethod(lambda cls, v: _check_types(v, allowed, what))


def _tag(v: Any) -> Optional[str]:
    return v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None) or "message"


# ---- input items ------------------------------------------------------------------------------------
class InputText(_Request):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Optional[PromptCacheBreakpoint] = Field(None, description="accepted and ignored")


class OutputText(_Request):
    """An assistant's text given back in the history (a reply's `output` item, `model_dump()`ed)."""

    type: Literal["output_text"]
    text: str
    annotations: Optional[list[dict[str, Any]]] = Field(None, description="accepted and ignored")
    logprobs: Optional[list[dict[str, Any]]] = Field(None, description="accepted and ignored")


class Refusal(_Request):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[Union[InputText, OutputText, Refusal], Field(discriminator="type")]


class MessageItem(_Request):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None

    _parts = field_validator("content", mode="before")(_only_types(PART_TYPES, "content"))

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        # (joined as the chat route joins a message's parts)
        return "\n".join(p.refusal if p.type == "refusal" else p.text for p in self.content)


class FunctionCallItem(_Request):
    """A call the model made, given back in the history beside its function_call_output."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(..., description="a JSON object, as a string")
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    # What the SDK's model_dump() of an output item carries besides (`async_` under Python's name).
    async_: Optional[bool] = Field(None, validation_alias=AliasChoices("async", "async_"),
                                   description="accepted and ignored")
    caller: Optional[dict[str, Any]] = Field(None, description="accepted and ignored")
    namespace: Optional[str] = Field(None, description="accepted and ignored")


class FunctionCallOutputItem(_Request):
    """A tool's result: rendered as a tool message answering the call `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    name: Optional[str] = None
    caller: Optional[dict[str, Any]] = Field(None, description="accepted and ignored")
    namespace: Optional[str] = Field(None, description="accepted and ignored")

    _parts = field_validator("output", mode="before")(_only_types(("input_text",), "output"))

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]], Discriminator(_tag)]


# ---- tools, tool_choice, text format ------------------------------------------------------------------
class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME_PATTERN)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema of the arguments object")
    strict: Optional[bool] = Field(None, description="accepted; a forced call always follows the schema")

    def for_chat(self) -> dict:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(_Request):
    type: Literal["function"]
    name: str

    def for_chat(self) -> dict:
        return {"type": "function", "function": {"name": self.name}}


class AllowedToolsChoice(_Request):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[FunctionChoice] = Field(..., min_length=1)

    _functions = field_validator("tools", mode="before")(_only_types(("function",), "tool_choice.tools"))

    def for_chat(self) -> dict:
        return {"type": "allowed_tools", "allowed_tools": {"mode": self.mode,
                                                           "tools": [t.for_chat() for t in self.tools]}}


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, description="accepted, not used")
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="json_schema: the JSON schema")
    description: Optional[str] = None
    strict: Optional[bool] = Field(None, description="accepted; the output always follows the schema")

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        schema_iff_json_schema(self.type, self.schema_, "schema", "a format of type 'json_schema' needs its 'schema'")
        return self

    def for_chat(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name or "output", "schema": self.schema_,
                                                       "strict": self.strict}}


class TextConfig(_Request):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = Field(None, description="ignored")


class Reasoning(_Request):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: Optional[bool] = Field(None, description="accepted and ignored: events carry no padding")


# `include` values that ask for what this server never produces (search results, images, encrypted
# reasoning): honoured by leaving nothing out. Only logprobs would be missing, so they are refused.
_UNSERVED_INCLUDES = ("message.output_text.logprobs",)


class ResponsesRequest(_Request):
    model: Optional[str] = Field(None, description="the served model name; default: the one model served")
    input: Union[str, list[InputItem]] = Field(..., description="a user message's text, or a list of items")
    instructions: Optional[str] = Field(None, description="a system message before the input (not carried over "
                                                          "by previous_response_id)")
    previous_response_id: Optional[str] = Field(None, description="continue after a stored response: its input "
                                                "and output come before this input")
    store: Optional[bool] = Field(True, description="keep the response (in memory, bounded) for "
                                                    "GET /v1/responses/{id} and previous_response_id")
    max_output_tokens: Optional[int] = Field(None, ge=1, description="default: what is left of the context")
    temperature: Optional[Annotated[Temperature, Field(le=2.0)]] = None
    top_p: Optional[TopP] = None
    tools: Optional[list[FunctionTool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionChoice, AllowedToolsChoice]] = Field(
        None, description="default: 'auto' with tools (needs --enable-auto-tool-choice), else 'none'")
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[int] = Field(None, ge=1, description="at most this many function calls in the reply")
    text: Optional[TextConfig] = None
    stream: Optional[bool] = False
    stream_options: Optional[ResponsesStreamOptions] = None
    metadata: Optional[dict[str, str]] = Field(None, max_length=16, description="echoed in the response")
    include: Optional[list[str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = Field(
        None, description="'auto' is accepted, but an input too long for the context is still a 400")
    top_logprobs: Optional[int] = Field(None, description="only 0: log-probabilities are not returned here")
    # ---- accepted and ignored: they change nothing here ----
    reasoning: Optional[Reasoning] = Field(None, description="ignored: no reasoning phase")
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = Field(None, description="ignored: prefix caching needs no key")
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority", "fast"]] = None
    # ---- accepted only as null / false ----
    background: Optional[bool] = Field(None, description="only false: responses run in the foreground")
    conversation: null_only("this server keeps no conversations; use previous_response_id") = None
    prompt: null_only("this server has no stored prompt templates") = None
    context_management: null_only("this server does not compact contexts") = None
    # ---- the other sampling knobs of the chat route (vLLM's extensions among them) ----
    top_k: Optional[int] = Field(None, ge=-1, description="-1 or 0 disables")
    min_p: Optional[MinP] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[RepetitionPenalty] = None
    seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)
    stop: Optional[Union[str, list[str]]] = Field(None, description=f"at most {MAX_STOP_STRINGS} stop strings")
    request_id: Optional[str] = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS,
                                      description="the response id becomes resp-<request_id>")
    # vLLM's ResponsesRequest extensions, checked and honoured as the chat route does (protocol_vllm_fields.py)
    priority: Optional[int] = Field(None, description="only 0 (or null): first come, first served")
    cache_salt: Optional[str] = Field(None, min_length=1, description="prefix-cache blocks are shared only among "
                                                                     "requests with the same salt")

    _tools = field_validator("tools", mode="before")(_only_types(("function",), "tools"))

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_choice(cls, v):
        if isinstance(v, dict) and v.get("type") not in ("function", "allowed_tools"):
            raise ValueError(f"tool_choice of type {v.get('type')!r} is not supported; send 'none', 'auto', "
                             f"'required', a function ({{\"type\": \"function\", \"name\": ...}}) or allowed_tools")
        return v

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input is an empty list; send at least one item")
        return _check_types(v, ITEM_TYPES, "input", default="message")

    @field_validator("background")
    @classmethod
    def _foreground(cls, v):
        if v:
            raise ValueError("background responses are not supported: every response runs in the foreground "
                             "(only false or null is accepted)")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("only 0 is supported: this server returns no log-probabilities on /v1/responses")
        return v

    @field_validator("include")
    @classmethod
    def _includes(cls, v):
        for name in v or ():
            if name in _UNSERVED_INCLUDES:
                raise ValueError(f"{name!r} is not supported: this server returns no log-probabilities here")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        return stream_options_need_stream(self)

    def to_chat(self, messages: list[dict]) -> dict:
        """The body of the chat completion request that serves this one, for these chat `messages`."""
        # One call at most is what parallel_tool_calls=false asks for: a forced reply's grammar then ends it
        # after that call (more are cut off by the server: serving_responses.py).
        parallel = False if self.max_tool_calls == 1 else self.parallel_tool_calls
        body: dict[str, Any] = {"messages": messages, "max_tokens": self.max_output_tokens,
                                "parallel_tool_calls": parallel, "request_id": self.request_id}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "seed", "stop", "priority", "cache_salt"):
            body[name] = getattr(self, name)
        if self.tools is not None:
            body["tools"] = [t.for_chat() for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.for_chat()
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.for_chat()
        return {k: v for k, v in body.items() if v is not None}


# ---- the response -----------------------------------------------------------------------------------
def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputTextPart(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(_Response):
    id: str = Field(default_factory=lambda: new_item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputTextPart] = Field(default_factory=list)


class OutputFunctionCall(_Response):
    id: str = Field(default_factory=lambda: new_item_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "completed"
    call_id: str
    name: str
    arguments: str


OutputItem = Union[OutputMessage, OutputFunctionCall]


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Optional[Literal["max_output_tokens"]] = Field(..., description="null: the server aborted it (shutdown)")


class ResponseErrorInfo(_Response):
    code: str
    message: str


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "incomplete"]


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    error: Optional[ResponseErrorInfo] = None
    incomplete_details: Optional[IncompleteDetails] = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: Optional[ResponseUsage] = None
    # the request's settings, as OpenAI echoes them
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    max_tool_calls: Optional[int] = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    store: bool = True
    temperature: Optional[float] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: Optional[float] = None
    truncation: Literal["auto", "disabled"] = "disabled"
    user: Optional[str] = None

    @classmethod
    def started(cls, response_id: str, model: str, req: ResponsesRequest) -> "ResponseObject":
        """The response of `req` before any output (status in_progress): its settings filled in."""
        return cls(id=response_id, model=model, status="in_progress", instructions=req.instructions,
                   max_output_tokens=req.max_output_tokens, max_tool_calls=req.max_tool_calls,
                   metadata=req.metadata or {}, parallel_tool_calls=req.parallel_tool_calls is not False,
                   previous_response_id=req.previous_response_id,
                   reasoning=req.reasoning.model_dump() if req.reasoning else None, store=req.store is not False,
                   temperature=req.temperature, top_p=req.top_p, truncation=req.truncation or "disabled",
                   user=req.user, tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
                   tool_choice=(req.tool_choice if isinstance(req.tool_choice, str) else
                                req.tool_choice.model_dump() if req.tool_choice is not None else
                                "auto" if req.tools else "none"),
                   text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
                   if req.text is not None and req.text.format is not None else {"format": {"type": "text"}})


class ResponseDeleted(_Response):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
