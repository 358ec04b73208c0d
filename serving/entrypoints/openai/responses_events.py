"""A response's output items built from the reply as it is generated, and the Responses API's stream
events that say so (`ResponseBuilder`).

The reply's text and tool-call pieces (tool_parsers.ToolCallStream's output) go in; out come the events
the SDK reads, in OpenAI's order: response.created and .in_progress; per output item
response.output_item.added, then for a message response.content_part.added, .output_text.delta ...,
.output_text.done, .content_part.done, for a function call .function_call_arguments.delta ...,
.function_call_arguments.done; response.output_item.done; and last response.completed (or .incomplete,
or .failed). Every event carries the next `sequence_number`.

A non-streamed response is built by the same class with the whole reply pushed at once, so the two
agree item for item."""

from __future__ import annotations

from typing import Optional

from .chat_messages import DeltaToolCall
from .chat_tools import _whole_json
from .protocol_responses import (IncompleteDetails, OutputFunctionCall, OutputItem, OutputMessage, OutputTextPart,
                                 ResponseErrorInfo, ResponseObject, ResponseUsage)


class ResponseBuilder:
    def __init__(self, response: ResponseObject):
        self.response = response
        self.seq = 0
        self._open: Optional[OutputItem] = None
        self._blank = ""   # whitespace after a call: kept back, it starts no message of its own

    def _event(self, kind: str, **fields) -> dict:
        out = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return out

    def _snapshot(self) -> dict:
        return self.response.model_dump()

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    # ---- items ----------------------------------------------------------------------------------------
    def _add(self, item: OutputItem) -> list[dict]:
        events = self._close()
        item.status = "in_progress"
        self.response.output.append(item)
        self._open = item
        events.append(self._event("response.output_item.added", output_index=self._index(),
                                  item=item.model_dump()))
        if isinstance(item, OutputMessage):
            item.content.append(OutputTextPart(text=""))
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=self._index(),
                                      content_index=0, part=OutputTextPart(text="").model_dump()))
        return events

    def _index(self) -> int:
        return len(self.response.output) - 1

    def _close(self, status: str = "completed") -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        i = self.response.output.index(item)
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events = [self._event("response.output_text.done", item_id=item.id, output_index=i, content_index=0,
                                  text=part.text, logprobs=[]),
                      self._event("response.content_part.done", item_id=item.id, output_index=i, content_index=0,
                                  part=part.model_dump())]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item.id, output_index=i,
                                  name=item.name, arguments=item.arguments)]
        events.append(self._event("response.output_item.done", output_index=i, item=item.model_dump()))
        return events

    # ---- what the model generates ---------------------------------------------------------------------
    def text(self, delta: str) -> list[dict]:
        if not delta:
            return []
        events = []
        if not isinstance(self._open, OutputMessage):
            if self._open is not None and not (self._blank + delta).strip():
                self._blank += delta
                return []
            self._blank = ""
            events += self._add(OutputMessage())
        part = self._open.content[0]
        part.text += delta
        events.append(self._event("response.output_text.delta", item_id=self._open.id, output_index=self._index(),
                                  content_index=0, delta=delta, logprobs=[]))
        return events

    def tool_call(self, d: DeltaToolCall) -> list[dict]:
        events = []
        if d.id is not None:   # a new call: its id and name come with its first piece
            events += self._add(OutputFunctionCall(call_id=d.id, name=d.function.name, arguments=""))
        args = d.function.arguments if d.function is not None else None
        if args and isinstance(self._open, OutputFunctionCall):
            self._open.arguments += args
            events.append(self._event("response.function_call_arguments.delta", item_id=self._open.id,
                                      output_index=self._index(), delta=args))
        return events

    # ---- the end --------------------------------------------------------------------------------------
    def finish(self, finish_reason: Optional[str], input_tokens: int, output_tokens: int) -> list[dict]:
        """The last events: the open item closed (incomplete when the reply was cut), the response's status
        and usage set. `finish_reason` is chat's (chat_tools.finish_reason): "tool_calls" for a forced reply
        whose JSON was complete when max_output_tokens came is complete."""
        events = [] if self.response.output else self._add(OutputMessage())   # a reply of nothing: one empty message
        cut = finish_reason in ("length", "abort")
        # A call cut after its arguments' JSON was complete is a whole call (the reply was cut after it).
        whole = isinstance(self._open, OutputFunctionCall) and _whole_json(self._open.arguments)
        events += self._close("incomplete" if cut and not whole else "completed")
        self.response.usage = ResponseUsage(input_tokens=input_tokens, output_tokens=output_tokens,
                                            total_tokens=input_tokens + output_tokens)
        if cut:
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(
                reason="max_output_tokens" if finish_reason == "length" else None)
            return events + [self._event("response.incomplete", response=self._snapshot())]
        self.response.status = "completed"
        return events + [self._event("response.completed", response=self._snapshot())]

    def failed(self, message: str) -> list[dict]:
        self.response.status = "failed"
        self.response.error = ResponseErrorInfo(code="server_error", message=message)
        return [self._event("response.failed", response=self._snapshot())]

    def conversation_turn(self) -> dict:
        """The reply as one assistant chat message (its text and its calls), for the store."""
        texts = [i.content[0].text for i in self.response.output if isinstance(i, OutputMessage) and i.content]
        calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
                 for i in self.response.output if isinstance(i, OutputFunctionCall)]
        out: dict = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
        if calls:
            out["tool_calls"] = calls
        return out
