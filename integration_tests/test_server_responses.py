"""The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) through the official `openai`
client, black-box on a `tp-overlap serve` process with the demo model and the hermes tool parser:
`output_text` of text and message-list input, streamed (the SDK's events, and its `responses.stream`
helper) and not, the same text as the chat route for the same messages; function tools (forced calls
validated against their parameters, their results given back as function_call_output items); the store
behind `previous_response_id`; errors that name the field. The store's bounds are checked on the class."""

import asyncio
import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from serving_helpers import ServerProcess
from tp_overlap_plugin.serving.entrypoints.openai.chat_messages import DeltaFunctionCall, DeltaToolCall
from tp_overlap_plugin.serving.entrypoints.openai.protocol_responses import ResponseObject
from tp_overlap_plugin.serving.entrypoints.openai.responses_events import ResponseBuilder
from tp_overlap_plugin.serving.entrypoints.openai.responses_store import ResponseStore
from tp_overlap_plugin.serving.entrypoints.openai.server_shutdown import InFlight
from tp_overlap_plugin.serving.entrypoints.openai.serving_base import EngineFailure
from tp_overlap_plugin.serving.entrypoints.openai.serving_responses import OpenAIServingResponses
from tp_overlap_plugin.serving.metrics import ServerMetrics

pytestmark = pytest.mark.timeout(180)

ARGS = ["--max-model-len", "512", "--no-access-log", "--log-level", "warning",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
# A small schema: on 2 CPU cores each forced token costs a grammar step.
W = {"type": "object", "properties": {"u": {"enum": ["C", "F"]}, "d": {"type": "integer", "minimum": 1,
                                                                       "maximum": 7}}, "required": ["u", "d"]}
TOOLS = [{"type": "function", "name": "w", "description": "weather", "parameters": W}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "w", "description": "weather", "parameters": W}}]
NAMED_W = {"type": "function", "name": "w"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _prompt_tokens(server, messages, tools=None) -> int:
    """What the chat route feeds the model for these messages (and tools): /tokenize renders them alike."""
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    return httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["count"]


def _events(stream) -> tuple[list, object]:
    """The SDK's events of a stream, checked for OpenAI's framing; and the response of the last one."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response


def test_text_input_streamed_and_not_is_the_chat_routes_reply(server, client):
    whole = client.responses.create(model="demo", input="Hello there", max_output_tokens=12, temperature=0)
    assert whole.object == "response" and whole.model == "demo" and whole.output_text
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=12, temperature=0)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens == _prompt_tokens(
        server, [{"role": "user", "content": "Hello there"}])
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    if chat.choices[0].finish_reason == "length":   # cut by max_output_tokens: OpenAI's "incomplete"
        assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    else:
        assert whole.status == "completed" and whole.incomplete_details is None

    events, final = _events(client.responses.create(model="demo", input="Hello there", max_output_tokens=12,
                                                    temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert deltas and set(kinds[4:-4]) == {"response.output_text.delta"}
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    assert "".join(e.delta for e in deltas) == events[-4].text == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    # The SDK's stream helper reads the same events (its get_final_response() wants response.completed,
    # which a reply cut by max_output_tokens does not end with, at OpenAI's either: see the tools test).
    with client.responses.stream(model="demo", input="Hello there", max_output_tokens=12, temperature=0) as s:
        assert list(s)[-1].response.output_text == whole.output_text


def test_messages_and_instructions_render_as_chat_messages(server, client):
    items = [{"role": "developer", "content": "Answer in French."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "!"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour",
                                                                   "annotations": []}]},
             {"role": "user", "content": "More"}]
    # The chat route's other sampling knobs pass through (the SDK sends them as extra_body).
    knobs = {"repetition_penalty": 1.5, "presence_penalty": 1.0, "top_k": 5}
    r = client.responses.create(model="demo", instructions="Be brief.", input=items, max_output_tokens=8,
                                temperature=0, metadata={"run": "7"}, extra_body=knobs)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Hi\n!"}, {"role": "assistant", "content": "Bonjour"},
                {"role": "user", "content": "More"}]
    assert r.usage.input_tokens == _prompt_tokens(server, messages)
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0,
                                          extra_body=knobs)
    plain = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0)
    assert r.output_text == chat.choices[0].message.content != plain.choices[0].message.content
    assert (r.instructions, r.metadata, r.max_output_tokens, r.temperature) == ("Be brief.", {"run": "7"}, 8, 0)


def test_function_tools_forced_streamed_and_given_back(server, client):
    r = client.responses.create(model="demo", input="Weather?", tools=TOOLS, tool_choice=NAMED_W,
                                max_output_tokens=40, temperature=0)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "w" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), W)
    assert r.tools[0].name == "w" and r.tool_choice.name == "w"

    with client.responses.stream(model="demo", input="Weather?", tools=TOOLS, tool_choice=NAMED_W,
                                 max_output_tokens=40, temperature=0) as s:
        events, final = _events(s)
        assembled = s.get_final_response()   # the SDK's helper builds the response from the events
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(pieces) > 3 and "".join(pieces) == done.arguments == call.arguments   # streamed as generated
    assert [(o.name, o.arguments) for o in final.output] == [("w", call.arguments)]
    assert [(o.name, o.arguments) for o in assembled.output] == [("w", call.arguments)]

    # 'required' with max_tool_calls=1: one call, and the reply ends after it.
    one = client.responses.create(model="demo", input="Weather?", tools=TOOLS, tool_choice="required",
                                  max_tool_calls=1, max_output_tokens=60, temperature=0)
    assert one.status == "completed" and [o.type for o in one.output] == ["function_call"]
    assert one.max_tool_calls == 1

    # The call (the SDK's own object, and its model_dump()) and its result go back in.
    for given in (call, call.model_dump()):
        history = [{"role": "user", "content": "Weather?"}, given,
                   {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        again = client.responses.create(model="demo", input=history, tools=TOOLS, tool_choice="none",
                                        max_output_tokens=4, temperature=0)
        chat = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                 "function": {"name": "w", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny", "name": "w"}]
        assert again.usage.input_tokens == _prompt_tokens(server, chat, CHAT_TOOLS)
        assert again.output[0].type == "message"


def test_auto_tool_choice_parses_with_the_servers_parser(client):
    """The demo's replies are no calls: 'auto' (the default with tools) gives the text 'none' gives."""
    auto = client.responses.create(model="demo", input="Weather?", tools=TOOLS, max_output_tokens=12, temperature=0)
    none = client.responses.create(model="demo", input="Weather?", tools=TOOLS, tool_choice="none",
                                   max_output_tokens=12, temperature=0)
    assert auto.output_text == none.output_text and [o.type for o in auto.output] == ["message"]
    assert auto.tool_choice == "auto" and none.tool_choice == "none"


def test_json_schema_text_format(client):
    fmt = {"type": "json_schema", "name": "weather", "schema": W, "strict": True}
    r = client.responses.create(model="demo", input="Weather?", text={"format": fmt}, max_output_tokens=40,
                                temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), W)


def test_previous_response_id_retrieve_and_delete(server, client):
    first = client.responses.create(model="demo", input="One", instructions="Be brief.", max_output_tokens=6,
                                    temperature=0)
    second = client.responses.create(model="demo", input="Two", previous_response_id=first.id, max_output_tokens=6,
                                     temperature=0)
    # The first's input and output come first; its instructions are not carried over.
    convo = [{"role": "user", "content": "One"}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "Two"}]
    assert second.usage.input_tokens == _prompt_tokens(server, convo)
    assert second.previous_response_id == first.id
    got = client.responses.retrieve(second.id)
    assert got.model_dump() == second.model_dump()

    streamed = list(client.responses.create(model="demo", input="Three", previous_response_id=second.id,
                                            max_output_tokens=4, stream=True))[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text

    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = client.responses.create(model="demo", input="One", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="demo", input="x", previous_response_id=unstored.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and unstored.id in e.value.body["message"]


@pytest.mark.parametrize("kw, param, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content", "'input_image'"),
    ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "input", "'reasoning'"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id", "missing"),
    ({"input": []}, "input", "empty"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format",
     "cannot be combined"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "context"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"background": True}, "background", "foreground"),
    ({"top_logprobs": 2}, "top_logprobs", "log-probabilities"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
])
def test_errors_name_the_field(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": "demo", "input": "x", "max_output_tokens": 4, **kw})
    body = e.value.body
    assert body["param"] == param and words in body["message"] and body["type"] == "invalid_request_error", body


def test_request_id_names_the_response(client):
    raw = client.responses.with_raw_response.create(model="demo", input="x", max_output_tokens=1,
                                                    extra_body={"request_id": "run-42"})
    assert raw.parse().id == "resp-run-42" and raw.headers["x-request-id"] == "run-42"


def test_unknown_model_and_ids_are_404(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="other", input="x")
    assert e.value.body["param"] == "model"
    r = httpx.delete(server.url + "/v1/responses/resp-none", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_metrics_count_the_route_by_its_name(client, server):
    client.responses.create(model="demo", input="x", max_output_tokens=1)
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'tp_overlap_http_responses_total{route="/v1/responses",status="200"}' in metrics


def _response(i: int) -> ResponseObject:
    return ResponseObject(id=f"resp-{i}", model="demo", status="completed")


def test_the_store_keeps_the_most_recently_used_within_its_bounds():
    store = ResponseStore(capacity=2, max_chars=10_000)
    for i in range(3):
        store.put(_response(i), [{"role": "user", "content": str(i)}])
        if i == 1:
            assert store.get("resp-0") is not None   # used: resp-1 is now the oldest
    assert store.get("resp-1") is None and store.get("resp-0") is not None and len(store) == 2
    store.put(_response(3), [{"role": "user", "content": "x" * 20_000}])   # alone over the bound: evicted too
    assert len(store) == 0
    store.put(_response(4), [])
    assert store.delete("resp-4") and not store.delete("resp-4")


# ---- the event builder and the stream's envelope, without a server -----------------------------------
def _call(i, call_id=None, name=None, args=None):
    return DeltaToolCall(index=i, id=call_id, type="function" if call_id else None,
                         function=DeltaFunctionCall(name=name, arguments=args))


def test_the_builder_orders_items_and_events_as_openai():
    b = ResponseBuilder(_response(0))
    events = b.start() + b.text("Let me ") + b.text("check.") + b.tool_call(_call(0, "call_1", "w", '{"u"'))
    events += b.tool_call(_call(0, args=': "C"}')) + b.text("\n")   # whitespace after a call opens no message
    events += b.tool_call(_call(1, "call_2", "w", '{"u": ')) + b.finish("length", 5, 7)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    out = events[-1]["response"]
    assert [(o["type"], o["status"]) for o in out["output"]] == [("message", "completed"),
                                                                ("function_call", "completed"),
                                                                ("function_call", "incomplete")]   # its JSON was cut
    assert out["output"][0]["content"][0]["text"] == "Let me check." and out["output"][1]["arguments"] == '{"u": "C"}'
    assert out["incomplete_details"] == {"reason": "max_output_tokens"} and out["usage"]["total_tokens"] == 12
    assert b.conversation_turn() == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"u": "C"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "w", "arguments": '{"u": '}}]}
    empty = ResponseBuilder(_response(1))
    done = empty.finish("stop", 3, 0)
    assert done[-1]["type"] == "response.completed" and done[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_an_engine_failure_mid_stream_ends_it_with_response_failed():
    engine = SimpleNamespace(tokenizer=None, max_model_len=64)
    serving = OpenAIServingResponses(engine, "demo", ServerMetrics("demo", lambda: None), InFlight())
    builder = ResponseBuilder(_response(2))

    async def events():
        for e in builder.start() + builder.text("partial"):
            yield e
        raise EngineFailure("injected")

    async def read(response):
        return [chunk async for chunk in response.body_iterator]

    frames = asyncio.run(read(serving._event_stream("resp-2", events(), builder)))
    assert frames[0].startswith("event: response.created\ndata: {")
    last = json.loads(frames[-1].split("data: ", 1)[1])
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert "injected" in last["response"]["error"]["message"] and last["sequence_number"] == len(frames) - 1
