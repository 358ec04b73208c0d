"""POST /v1/responses (OpenAI's Responses API), and GET / DELETE /v1/responses/{id}, over the chat path.

A request is rendered as the chat completion request that serves it (protocol_responses.py): the stored
conversation of `previous_response_id`, then `instructions` as a system message, then the input items as
chat messages; its tools, tool_choice and text.format as chat's. That request's tool plan, template, context
check and sampling parameters are the chat route's; one engine request generates the reply, and
responses_events.ResponseBuilder turns it into output items (and, streamed, into the API's events).

With `store` (the default, as in OpenAI's API) the response and its conversation are kept in memory
(responses_store.py) for GET /v1/responses/{id} and `previous_response_id`."""

from __future__ import annotations

import contextlib
import json
from typing import AsyncIterator, Optional, Union

from fastapi import Request
from pydantic import ValidationError

from .chat_tools import finish_reason, plan_tools
from .protocol import ChatCompletionRequest
from .protocol_responses import (FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponseDeleted,
                                 ResponseObject, ResponsesRequest)
from .responses_events import ResponseBuilder
from .responses_store import ResponseStore
from .server_errors import ApiError, describe_validation_errors
from .serving_base import EngineFailure, OpenAIServing, SSEResponse
from .tool_parsers import ToolCallStream


# Chat's names of the fields an error may name, and the Responses API's.
_RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def _renamed(e: ApiError) -> ApiError:
    if e.param is None:
        return e
    head = e.param.partition(".")[0]
    param = _RENAMED.get(head, e.param)
    message = e.message
    for chat in ("max_tokens", "response_format"):   # (field names, not words that prose might use)
        message = message.replace(chat, _RENAMED[chat])
    return ApiError(e.status, message, param=param, code=e.code)


def input_messages(items: Union[str, list]) -> list[dict]:
    """The input items as chat messages: a function call joins the assistant message before it (the reply
    that made it), a function_call_output is the tool message answering it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    names: dict[str, str] = {}
    for item in items:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            msg = {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
            name = item.name or names.get(item.call_id)
            if name is not None:   # templates that label a result with its function's name find it
                msg["name"] = name
            out.append(msg)
    return out


def _sse_event(event: dict) -> str:
    # The Responses API names each event on its own line too, for clients that dispatch on it.
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, *shared, tool_parser: Optional[str] = None, store: Optional[ResponseStore] = None):
        super().__init__(*shared)
        self.tool_parser = tool_parser
        self.store = store if store is not None else ResponseStore()

    # ---- the stored responses -------------------------------------------------------------------------
    def _not_found(self, response_id: str, param: Optional[str] = None, code: str = "not_found") -> ApiError:
        return ApiError(404, f"no stored response has the id {response_id!r} (responses sent with store=false are "
                             f"not kept; this server keeps the last {self.store.capacity} in memory, until it "
                             f"restarts)", param=param, code=code)

    def retrieve(self, response_id: str) -> ResponseObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise self._not_found(response_id)
        return entry.response

    def delete(self, response_id: str) -> ResponseDeleted:
        if not self.store.delete(response_id):
            raise self._not_found(response_id)
        return ResponseDeleted(id=response_id)

    # ---- POST /v1/responses -----------------------------------------------------------------------------
    def _chat_request(self, req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
        try:
            return ChatCompletionRequest.model_validate(req.to_chat(messages))
        except ValidationError as e:
            msg, param = describe_validation_errors(e.errors())
            raise ApiError(400, msg, param=param) from None

    def _conversation(self, req: ResponsesRequest) -> list[dict]:
        """The chat messages before the generation prompt, but for `instructions`: the stored conversation of
        previous_response_id, then the input."""
        conversation = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise self._not_found(req.previous_response_id, "previous_response_id", "previous_response_not_found")
            conversation = list(previous.conversation)
        return conversation + input_messages(req.input)

    def _prepare(self, req: ResponsesRequest, conversation: list[dict], request: Request):
        """What the chat route would make of this request: (tool plan, prompt ids, the engine request's
        Choice, the response id). Its errors name the chat route's fields; create() renames them."""
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        chat = self._chat_request(req, system + conversation)
        plan = plan_tools(chat, self.tool_parser)
        if req.max_tool_calls is not None:
            plan.max_calls = min(plan.max_calls or req.max_tool_calls, req.max_tool_calls)
        ids = self._chat_ids([m.for_template() for m in chat.messages], True, plan.template_tools)
        try:
            self._check_context(len(ids), req.max_output_tokens, "max_output_tokens", "input")
        except ApiError as e:
            if req.truncation == "auto":
                e.message += " (truncation 'auto' drops no input items on this server: shorten the input)"
            raise
        max_tokens = self.max_model_len - len(ids) if req.max_output_tokens is None else req.max_output_tokens
        kw = dict(chat.sampling_kwargs(), max_tokens=max_tokens)
        if plan.forced:
            kw["structured_output"] = plan.structured_output
        base, engine_id = self._response_id("resp", req, request)
        try:
            choices = self._make_choices(engine_id, [(None, ids)], 1, kw, req.seed, "text.format")
        except ApiError as e:
            if plan.forced and e.param == "text.format":   # the grammar made of the tools' parameters
                raise ApiError(400, f"the tools' parameters cannot be forced: {e.message}", param="tools") from None
            raise
        return plan, ids, choices[0], base

    async def create(self, req: ResponsesRequest, request: Request):
        self.check_model(req.model)
        conversation = self._conversation(req)
        try:
            plan, ids, c, base = self._prepare(req, conversation, request)
        except ApiError as e:
            raise _renamed(e) from None
        builder = ResponseBuilder(ResponseObject.started(base, self.model_name, req))
        calls = ToolCallStream(plan.parser, plan.max_calls) if plan.parser else None

        def push(text: str, final: bool) -> list[dict]:
            if calls is None:
                return builder.text(text)
            content, deltas = calls.push(text, final=final)
            events = builder.text(content)
            for d in deltas:
                events += builder.tool_call(d)
            return events

        def finish() -> list[dict]:
            reason = finish_reason(plan, calls is not None and calls.called, c.text, c.finish_reason)
            events = builder.finish(reason, len(ids), len(c.token_ids))
            if req.store is not False:
                self.store.put(builder.response, conversation + [builder.conversation_turn()])
            return events

        if req.stream:
            async def events():
                for e in builder.start():
                    yield e
                async with contextlib.aclosing(self._run([c], "responses")) as it:
                    async for _, text in it:
                        for e in push(text, c.finish_reason is not None):
                            yield e
                for e in finish():
                    yield e

            return self._event_stream(base, events(), builder)

        await self._complete([c], "responses", request)
        push(c.text, True)
        finish()
        return builder.response

    def _event_stream(self, response_id: str, events: AsyncIterator[dict], builder: ResponseBuilder) -> SSEResponse:
        """The stream in the shared SSE envelope (OpenAIServing._sse). A failure after the first event ends it
        with response.failed (the status line has gone out); a client that leaves aborts the engine request
        (closing `events` closes _run)."""

        async def frames():
            async with contextlib.aclosing(events) as it:
                async for event in it:
                    yield _sse_event(event)

        def failed(e: Exception) -> list[str]:
            why = (f"the engine failed while generating: {e}" if isinstance(e, EngineFailure)
                   else f"internal server error: {type(e).__name__}: {e}")
            return [_sse_event(event) for event in builder.failed(why)]
        return self._sse(response_id, frames(), failed)
