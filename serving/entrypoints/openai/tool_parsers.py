"""Tool calls out of a model's text: the `--tool-call-parser` formats (`hermes`, `llama3_json`) and the
JSON that a forced call (tool_choice `required` or a named function) is generated as.

Each parser reads the whole text so far and returns a `Snapshot`: the content text that may be shown
and the calls seen, each with its name and its argument text so far. While generation goes on
(`final=False`) a snapshot only ever grows: text that could still turn out to begin a call is held
back, a call appears once its name is complete, and its arguments grow as they are generated. So the
stream (`ToolCallStream`, the differences between snapshots) and the reply that is not streamed (the
final snapshot) tell the same calls and the same content. The one exception is a call whose arguments
never complete as JSON (cut by max_tokens, or malformed): the final snapshot returns its text as content
(auto) or drops it (forced), while a stream has already sent its first pieces. (Text after a complete
call's arguments that does not close the call as it should is dropped, or for llama3_json is content:
the call stands, as it was streamed.)

A call's arguments are the model's own JSON text (the object it wrote), so streamed pieces add up to
exactly the reply's `arguments`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from .chat_messages import DeltaFunctionCall, DeltaToolCall, new_call_id

_DECODER = json.JSONDecoder()
# The start of a call object written name first: {"name": "...", "arguments": (or "parameters":, Llama's)
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_WS = re.compile(r"\s*")


@dataclass
class PartialCall:
    name: str
    arguments: str            # the argument JSON text so far
    complete: bool            # the arguments are a whole JSON value


@dataclass
class Snapshot:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class _Scan:
    call: Optional[PartialCall]   # None: the name is not complete yet, or this is no call
    end: Optional[int]            # where the call object ends in the text, once it is complete
    invalid: bool = False         # the text cannot become a call


def _scan_call(text: str, pos: int) -> _Scan:
    """The call object that starts at text[pos:] (after optional whitespace)."""
    head = _CALL_HEAD.match(text, pos)
    if head is None:
        # Not written name first, or the name is not complete yet: a whole object decides.
        start = _WS.match(text, pos).end()
        if start == len(text):
            return _Scan(None, None)
        if text[start] != "{":
            return _Scan(None, None, invalid=True)
        try:
            obj, end = _DECODER.raw_decode(text, start)
        except ValueError:
            return _Scan(None, None)
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
            return _Scan(None, None, invalid=True)
        return _Scan(PartialCall(obj["name"], _arguments_text(args), True), end)
    name = json.loads(f'"{head.group(1)}"')
    start = head.end()
    try:
        value, value_end = _DECODER.raw_decode(text, start)
    except ValueError:
        # Arguments still being written: all of the text so far is theirs (an object is streamed as it
        # grows; anything else is only shown whole).
        partial = text[start:] if text[start:start + 1] == "{" else ""
        return _Scan(PartialCall(name, partial, False), None)
    call = PartialCall(name, _arguments_text(value, text[start:value_end]), True)
    close = _WS.match(text, value_end).end()
    if close == len(text):
        return _Scan(call, None)
    # Complete arguments are a call even if the object does not close as it should: it was streamed as one.
    return _Scan(call, close + 1 if text[close] == "}" else close)


def _arguments_text(value, raw: Optional[str] = None) -> str:
    if isinstance(value, str):   # arguments written as a JSON string of the object
        return value
    if raw is not None and isinstance(value, dict):
        return raw
    return json.dumps(value, ensure_ascii=False)


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Turns generated text into content and tool calls (module docstring)."""

    name: ClassVar[str]
    forced: ClassVar[bool] = False

    def snapshot(self, text: str, final: bool) -> Snapshot:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Qwen2.5 / Qwen3 (Hermes format): calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks; the text outside them is the content, less the whitespace next to a block."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        parts: list[str] = []
        calls: list[PartialCall] = []
        pos, after_call, glue = 0, False, False

        def add(segment: str) -> None:
            if glue and parts:
                parts[-1] += segment
            else:
                parts.append(segment)

        while True:
            i = text.find(self.START, pos)
            segment = text[pos:] if i < 0 else text[pos:i]
            if after_call:
                segment = segment.lstrip()
            if i < 0:
                if not final:
                    # Hold what may begin a block, and the whitespace that is dropped before one.
                    segment = segment[:len(segment) - _held_prefix(segment, self.START)].rstrip()
                add(segment)
                break
            j = text.find(self.END, i)
            block_end = len(text) if j < 0 else j + len(self.END)
            body = text[i + len(self.START):j if j >= 0 else len(text)]
            scan = _scan_call(body, 0)
            if j < 0 and not final and (scan.call is None or scan.invalid):
                add(segment.rstrip())   # undecided until the block closes
                break
            if j < 0 and not final:
                is_call = True          # a call being written
            else:
                # (What follows a complete call inside its block is dropped: the call was streamed already.)
                is_call = scan.call is not None and not scan.invalid and scan.call.complete
            if is_call:
                add(segment.rstrip())
                calls.append(scan.call)
                after_call, glue = True, False
            else:                       # not a call after all: the block's text is content
                add(segment + text[i:block_end])
                after_call, glue = False, True
            if j < 0:
                break
            pos = block_end
        return Snapshot("\n".join(p for p in parts if p), calls)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls: a reply that begins (after an optional <|python_tag|>) with one or
    more `{"name": ..., "parameters": {...}}` objects separated by `;` is calls, and text after them is
    content; a reply that begins otherwise is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):]
        elif body and self.TAG.startswith(body) and not final:
            return Snapshot()
        if not body.strip():
            return Snapshot(text if final else "")
        if body.lstrip()[0] != "{":
            return Snapshot(text)
        calls: list[PartialCall] = []
        pos = len(text) - len(body)
        while True:
            scan = _scan_call(text, pos)
            if scan.invalid or final and (scan.call is None or not scan.call.complete):
                return Snapshot(text)        # not the format: the whole reply is content
            if scan.call is None:
                return Snapshot("", calls)   # a name still being written
            calls.append(scan.call)
            if scan.end is None:
                return Snapshot("", calls)
            pos = _WS.match(text, scan.end).end()
            if pos == len(text):
                return Snapshot("", calls)
            if text[pos] != ";":
                return Snapshot(text[pos:], calls)   # prose after the calls: content
            pos += 1
            if not text[pos:].strip():
                return Snapshot("", calls)


class NamedCallParser(ToolParser):
    """A call forced to one function: the whole output is its arguments object."""

    forced = True

    def __init__(self, function_name: str):
        self.function_name = function_name

    def snapshot(self, text: str, final: bool) -> Snapshot:
        try:
            json.loads(text)
            complete = True
        except ValueError:
            complete = False
        if final and not complete:
            return Snapshot()   # cut short (max_tokens): no call to return
        return Snapshot("", [PartialCall(self.function_name, text, complete)])


class RequiredCallsParser(ToolParser):
    """Calls forced by tool_choice 'required': the output is `[{"name": ..., "arguments": {...}}, ...]`."""

    forced = True

    def snapshot(self, text: str, final: bool) -> Snapshot:
        calls: list[PartialCall] = []
        pos = _WS.match(text).end()
        if text[pos:pos + 1] != "[":
            return Snapshot()
        pos += 1
        while True:
            scan = _scan_call(text, pos)
            if scan.call is None or scan.invalid:
                break
            calls.append(scan.call)
            if scan.end is None:
                break
            pos = _WS.match(text, scan.end).end()
            if text[pos:pos + 1] != ",":
                break
            pos += 1
        if final:
            calls = [c for c in calls if c.complete]
        return Snapshot("", calls)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def get_parser(name: str) -> ToolParser:
    """The parser `name`; ValueError listing the choices when there is none of that name."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}") from None


class ToolCallStream:
    """One choice's stream: `push(new_text)` -> (content delta, tool-call deltas in OpenAI's shape), and
    `push("", final=True)` at the end. `max_calls` keeps only the first calls (parallel_tool_calls=false)."""

    def __init__(self, parser: ToolParser, max_calls: Optional[int] = None):
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.content = ""                        # content sent so far
        self.sent: list[tuple[str, str]] = []    # (id, arguments sent) per call

    def push(self, new_text: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        self.text += new_text
        snap = self.parser.snapshot(self.text, final)
        content = ""
        if snap.content.startswith(self.content):
            content = snap.content[len(self.content):]
            self.content = snap.content
        deltas = []
        for i, call in enumerate(snap.calls[:self.max_calls]):
            if i == len(self.sent):
                self.sent.append((new_call_id(), call.arguments))
                deltas.append(DeltaToolCall(index=i, id=self.sent[i][0], type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                continue
            call_id, sent = self.sent[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=call.arguments[len(sent):])))
                self.sent[i] = (call_id, call.arguments)
        return content, deltas

    @property
    def called(self) -> bool:
        return bool(self.sent)
