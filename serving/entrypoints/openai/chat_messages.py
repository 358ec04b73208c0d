"""Chat messages and tools as OpenAI's API and SDKs send them, and the tool calls a reply carries.

A message is one model per role (the `role` field picks it), so that a tool message without its
`tool_call_id` or a user message without content is refused naming the field. Every field of the SDK's
own message types is listed: what a reply's `message.model_dump()` carries (`refusal`, `annotations`,
`audio`, `function_call` as null, `content: null` beside `tool_calls`) comes back accepted. What cannot be
honoured (audio, custom tools) is accepted only as null and otherwise refused, naming the field.

`for_template()` is the message as a Hugging Face chat template takes it: assistant tool calls with
their arguments as an object (templates write them with `tojson`), tool results under role `tool`.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BeforeValidator, Field, model_validator

from .protocol_base import RequestModel, ResponseModel

# OpenAI allows 128 tools per request; each one's schema is compiled into a grammar when a call is forced.
MAX_TOOLS = 128
# OpenAI's rule for function names: letters, digits, underscores and dashes, at most 64.
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_\-]{1,64}$"


def null_only(why: str):
    """A field accepted only as null (SDKs send it so): any other value is a 400 saying `why`."""

    def check(v):
        if v is not None:
            raise ValueError(f"{why} (only null is accepted)")
        return v

    return Annotated[None, BeforeValidator(check), Field(description=f"only null: {why}")]


def _refuse_other_types(allowed: tuple[str, ...], what: str):
    """A before-validator: a part or tool of a `type` not in `allowed` is refused with one clear line
    (instead of pydantic's one error per field of the expected shape)."""

    def check(cls, data):
        if isinstance(data, dict) and data.get("type") not in allowed:
            shown = " or ".join(repr(a) for a in allowed)
            raise ValueError(f"{what} of type {data.get('type')!r} are not supported; only {shown}")
        return data

    return model_validator(mode="before")(classmethod(check))


# ---- content parts ----------------------------------------------------------------------------------
class PromptCacheBreakpoint(RequestModel):
    mode: Literal["explicit"]
    ttl: Optional[Literal["30m", "12h"]] = None


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: Optional[PromptCacheBreakpoint] = Field(
        None, description="accepted and ignored: prefix caching here needs no breakpoints")

    _only_text = _refuse_other_types(("text",), "content parts")


class RefusalContentPart(RequestModel):
    type: Literal["refusal"]
    refusal: str


AssistantContentPart = Annotated[Union[TextContentPart, RefusalContentPart], Field(discriminator="type")]


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.text if p.type == "text" else p.refusal for p in content)


# ---- tool calls in the history ----------------------------------------------------------------------
class FunctionCallParam(RequestModel):
    name: str
    arguments: str = Field(..., description="the call's arguments as a JSON string, as a reply carries them")


class ToolCallParam(RequestModel):
    id: str
    type: Literal["function"]
    function: FunctionCallParam

    _only_functions = _refuse_other_types(("function",), "tool calls")


def _arguments_for_template(arguments: str) -> Any:
    # Templates write a call's arguments with `tojson`, which would quote a JSON string once more.
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _call_for_template(call_id: Optional[str], fn: FunctionCallParam) -> dict:
    out = {"type": "function", "function": {"name": fn.name, "arguments": _arguments_for_template(fn.arguments)}}
    if call_id is not None:
        out["id"] = call_id
    return out


class UrlCitation(RequestModel):
    end_index: int
    start_index: int
    title: str
    url: str


class Annotation(RequestModel):
    type: Literal["url_citation"]
    url_citation: UrlCitation


# ---- messages ---------------------------------------------------------------------------------------
class _Message(RequestModel):
    name: Optional[str] = Field(None, description="the participant's name, passed to the chat template")

    def text(self) -> str:
        return _text(getattr(self, "content", None))

    def _base(self, role: str) -> dict:
        out = {"role": role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out


class SystemMessage(_Message):
    role: Literal["system", "developer"] = Field(
        ..., description="'developer' is OpenAI's newer name for the system message, and is rendered as one")
    content: Union[str, list[TextContentPart]]

    def for_template(self) -> dict:
        return self._base("system")


class UserMessage(_Message):
    role: Literal["user"]
    content: Union[str, list[TextContentPart]]

    def for_template(self) -> dict:
        return self._base("user")


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Optional[Union[str, list[AssistantContentPart]]] = Field(
        None, description="null beside tool_calls (a reply that only called tools)")
    tool_calls: Optional[list[ToolCallParam]] = None
    refusal: Optional[str] = Field(None, description="a refusal's text; rendered as the content when that is null")
    function_call: Optional[FunctionCallParam] = Field(
        None, description="the deprecated single call; rendered as one tool call")
    annotations: Optional[list[Annotation]] = Field(None, description="accepted and ignored (metadata of the content)")
    audio: null_only("this server produces no audio, so no reply of it has any") = None
    # vLLM's replies carry these; a client that talked to vLLM sends them back.
    reasoning_content: Optional[str] = Field(None, description="passed to the chat template (vLLM's field)")
    reasoning: Optional[str] = Field(None, description="the newer name of reasoning_content")

    def text(self) -> str:
        if self.content is None and self.refusal is not None:
            return self.refusal
        return _text(self.content)

    def for_template(self) -> dict:
        out = self._base("assistant")
        calls = [_call_for_template(c.id, c.function) for c in self.tool_calls or []]
        if self.function_call is not None:
            calls.append(_call_for_template(None, self.function_call))
        if calls:
            out["tool_calls"] = calls
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Union[str, list[TextContentPart]]
    tool_call_id: str = Field(..., description="the id of the assistant's call this is the result of")

    def for_template(self) -> dict:
        out = self._base("tool")
        out["tool_call_id"] = self.tool_call_id
        return out


class FunctionMessage(RequestModel):
    """The deprecated result of a `function_call`: rendered as a tool message."""

    role: Literal["function"]
    content: Optional[str]
    name: str

    def text(self) -> str:
        return self.content or ""

    def for_template(self) -> dict:
        return {"role": "tool", "content": self.text(), "name": self.name}


ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage, FunctionMessage],
                        Field(discriminator="role")]
# The discriminator's values, which pydantic puts into an error's location (server_errors.py drops them).
MESSAGE_TAGS = frozenset({"system", "developer", "user", "assistant", "tool", "function", "text", "refusal"})


# ---- tools and tool_choice --------------------------------------------------------------------------
class FunctionDefinition(RequestModel):
    name: str = Field(..., pattern=FUNCTION_NAME_PATTERN)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(
        None, description="a JSON schema of the arguments object; absent: the function takes none")
    strict: Optional[bool] = Field(None, description="accepted; a forced call always follows the schema")

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition

    _only_functions = _refuse_other_types(("function",), "tools")

    def for_template(self) -> dict:
        return self.model_dump(exclude_none=True)


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName

    _only_functions = _refuse_other_types(("function",), "named tool choices")


class AllowedTools(RequestModel):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(..., min_length=1)


class AllowedToolsChoice(RequestModel):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice, AllowedToolsChoice]


# ---- tool calls in a reply --------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class FunctionCall(ResponseModel):
    name: str
    arguments: str = Field(..., description="a JSON object, as a string")


class ToolCall(ResponseModel):
    id: str = Field(default_factory=new_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(ResponseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(ResponseModel):
    """A piece of call `index`: its first carries the id, type and name, the next ones more arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None
