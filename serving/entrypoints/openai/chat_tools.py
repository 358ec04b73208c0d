"""What a chat request's `tools` and `tool_choice` ask for, as vLLM serves them (`ToolPlan`), and the
reply's message built from the generated text.

- `none` (the default without tools): the tools are rendered, the reply is plain content.
- `auto` (the default with tools): the reply is parsed by the server's `--tool-call-parser`; without
  `--enable-auto-tool-choice` the request is a 400, as in vLLM.
- `required` and a named function: the call is forced. The output is generated under a JSON-schema
  grammar (structured.py) — the function's parameters for a named one, an array of at least one
  `{"name": <one of the tools>, "arguments": <its parameters>}` for `required` — so every call's
  arguments parse and follow the function's schema.
- `allowed_tools`: its mode (`auto` or `required`) over the tools it names; only those are rendered.

`parallel_tool_calls: false` keeps the first call of a parsed reply, and lets a forced `required`
reply have only one. A forced reply cut by max_tokens has finish_reason "length" and no tool_calls when
not streamed (its JSON is incomplete); a stream has sent the argument pieces generated until then.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from .chat_messages import AllowedToolsChoice, FunctionCall, NamedToolChoice, ToolCall
from .protocol import ChatCompletionRequest, ChatResponseMessage
from .server_errors import ApiError
from ...engine.structured import check_honoured
from .tool_parsers import NamedCallParser, RequiredCallsParser, ToolParser, get_parser


@dataclass
class ToolPlan:
    template_tools: Optional[list[dict]]            # the tools as the chat template takes them
    parser: Optional[ToolParser] = None             # None: the reply is plain content
    structured_output: Optional[dict] = None        # the forced call's grammar
    max_calls: Optional[int] = None                 # 1 with parallel_tool_calls=false

    @property
    def forced(self) -> bool:
        return self.structured_output is not None


def _choice_name(choice) -> str:
    return choice if isinstance(choice, str) else f"a named function ({choice.function.name!r})"


def plan_tools(req: ChatCompletionRequest, auto_parser: Optional[str]) -> ToolPlan:
    """The plan of `req`; `auto_parser` is the server's --tool-call-parser when --enable-auto-tool-choice
    is on, else None. ApiError (400, naming the field) for what cannot be served."""
    tools = list(req.tools or [])
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ApiError(400, f"tools[{i}]: the function name {name!r} is listed twice", param="tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, AllowedToolsChoice):
        allowed = [c.function.name for c in choice.allowed_tools.tools]
        unknown = [n for n in allowed if n not in names]
        if unknown:
            raise ApiError(400, f"tool_choice.allowed_tools names {unknown[0]!r}, which is not among the tools "
                                f"({', '.join(names) or 'none given'})", param="tool_choice")
        tools = [t for t in tools if t.function.name in allowed]
        choice = choice.allowed_tools.mode
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ApiError(400, f"tool_choice names the function {choice.function.name!r}, which is not among the "
                            f"tools ({', '.join(names) or 'none given'})", param="tool_choice")
    if choice == "required" and not tools:
        raise ApiError(400, "tool_choice 'required' needs tools to call; send 'tools'", param="tool_choice")
    plan = ToolPlan([t.for_template() for t in tools] or None)
    if choice == "none" or (choice == "auto" and not tools):
        return plan
    one = 1 if req.parallel_tool_calls is False else None
    if choice == "auto":
        if auto_parser is None:
            raise ApiError(400, "tool_choice 'auto' (the default when tools are given) needs the server started "
                                "with --enable-auto-tool-choice and --tool-call-parser; send tool_choice 'required', "
                                "a named function, or 'none'", param="tool_choice")
        plan.parser, plan.max_calls = get_parser(auto_parser), one
        return plan
    # A forced call: its JSON is the whole reply, so nothing else may shape or cut it.
    if req.response_format is not None and req.response_format.type != "text":
        raise ApiError(400, f"response_format {req.response_format.type!r} cannot be combined with tool_choice "
                            f"{_choice_name(choice)}: the forced call's JSON is the reply", param="response_format")
    for kind in req.structured_kinds():   # vLLM's guided_* / structured_outputs: the grammar is the call's
        raise ApiError(400, f"{kind} cannot be combined with tool_choice {_choice_name(choice)}: the forced "
                            f"call's JSON is the reply", param=kind)
    if req.stop_list():
        raise ApiError(400, f"stop strings cannot be combined with tool_choice {_choice_name(choice)}: they "
                            f"would cut the forced call's JSON", param="stop")
    index = {t.function.name: i for i, t in enumerate(req.tools or [])}
    for t in tools:
        if isinstance(choice, NamedToolChoice) and t.function.name != choice.function.name:
            continue
        try:
            check_honoured(t.function.parameters_schema(), f"tools[{index[t.function.name]}].function.parameters")
        except ValueError as e:
            raise ApiError(400, f"{e} (tool_choice {_choice_name(choice)} forces a call that follows it)",
                           param="tools") from None
    if isinstance(choice, NamedToolChoice):
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        plan.parser, plan.structured_output = NamedCallParser(fn.name), {"json_schema": fn.parameters_schema()}
        return plan
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                          "arguments": t.function.parameters_schema()},
         "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}}
    if one:
        schema["maxItems"] = 1
    plan.parser, plan.structured_output, plan.max_calls = RequiredCallsParser(), {"json_schema": schema}, one
    return plan


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def finish_reason(plan: ToolPlan, called: bool, text: str, finish: Optional[str]) -> Optional[str]:
    """OpenAI's "tool_calls" for a reply that ended with calls: ended by the model (or grammar), or a
    forced reply whose JSON was complete when max_tokens came."""
    if called and (finish == "stop" or (finish == "length" and plan.forced and _whole_json(text))):
        return "tool_calls"
    return finish


def reply_message(plan: ToolPlan, text: str) -> tuple[ChatResponseMessage, bool]:
    """The message of a finished reply, and whether it called tools."""
    if plan.parser is None:
        return ChatResponseMessage(content=text), False
    snap = plan.parser.snapshot(text, final=True)
    calls = snap.calls[:plan.max_calls]
    if not calls:
        return ChatResponseMessage(content=None if plan.forced else snap.content), False
    return ChatResponseMessage(content=snap.content or None, tool_calls=[
        ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]), True
