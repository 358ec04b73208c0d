"""Tool calling through the server and the official `openai` client, on the demo model: calls forced by
tool_choice (a named function, 'required') whose arguments validate against the function's parameters,
streamed in OpenAI's delta shape; 'auto' with the hermes parser (the demo's replies are no calls: they come
back as content) and with llama3_json (a reply made a call by response_format is returned as tool_calls);
'auto' refused without --enable-auto-tool-choice; a reply's `message.model_dump()` and the tool's result
sent back and rendered by the template. One engine behind three apps (each parser, and none)."""

import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import uvicorn

from tp_overlap_plugin.serving import AsyncLLM, EngineConfig
from tp_overlap_plugin.serving.entrypoints.openai.api_server import build_app
from serving_helpers import free_port

pytestmark = pytest.mark.timeout(240)

W = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7}},
     "required": ["city", "days"]}
T = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}
TOOLS = [{"type": "function", "function": {"name": "w", "description": "weather", "parameters": W}},
         {"type": "function", "function": {"name": "t", "parameters": T}}]
PARAMS = {"w": W, "t": T}
MSGS = [{"role": "user", "content": "Weather?"}]
NAMED_W = {"type": "function", "function": {"name": "w"}}


@pytest.fixture(scope="module")
def urls():
    """{"hermes" | "llama3_json" | "off": base url}: one engine, an app per --tool-call-parser and one without
    --enable-auto-tool-choice."""
    engine = AsyncLLM(EngineConfig(model="demo", max_model_len=1024, show_progress=False))
    servers, threads, out = [], [], {}
    try:
        for name, parser in (("hermes", "hermes"), ("llama3_json", "llama3_json"), ("off", None)):
            port = free_port()
            srv = uvicorn.Server(uvicorn.Config(build_app(engine, "demo", tool_parser=parser), host="127.0.0.1",
                                                port=port, log_level="warning", lifespan="off"))
            t = threading.Thread(target=srv.run, daemon=True)
            t.start()
            servers.append(srv)
            threads.append(t)
            out[name] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not all(s.started for s in servers):
            assert time.monotonic() < deadline, "in-process servers did not start"
            time.sleep(0.05)
        yield out
    finally:
        for s in servers:
            s.should_exit = True
        for t in threads:
            t.join(30)
        engine.shutdown()


_CLIENTS: dict = {}


def _chat(url, **kw):
    """The SDK's chat.completions.create against `url` (a stream is read after this returns: the client stays)."""
    if url not in _CLIENTS:
        _CLIENTS[url] = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return _CLIENTS[url].chat.completions.create(**{"model": "demo", "messages": MSGS, "tools": TOOLS,
                                                    "max_tokens": 48, **kw})


def _assemble(chunks):
    """(content, [(name, arguments)], finish_reason) of a streamed choice 0, checking OpenAI's delta shape."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
            else:
                assert tc.id is None and tc.function.name is None and tc.function.arguments, tc
                calls[tc.index][1] += tc.function.arguments
        finish = ch.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def _check_calls(choice, one=False):
    """A finished reply carries calls whose arguments validate against the function's parameters."""
    assert choice.finish_reason in ("tool_calls", "length"), choice
    calls = choice.message.tool_calls or []
    if choice.finish_reason == "tool_calls":
        assert calls and choice.message.content is None
    assert not one or len(calls) <= 1
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    return choice.finish_reason == "tool_calls"


def test_forced_calls_validate_against_the_functions_parameters(urls):
    named = _chat(urls["off"], tool_choice=NAMED_W, n=3, temperature=1.0, seed=7)
    assert sum(_check_calls(c) for c in named.choices) >= 2
    assert all(c.message.tool_calls[0].function.name == "w" for c in named.choices if c.finish_reason == "tool_calls")
    required = _chat(urls["off"], tool_choice="required", parallel_tool_calls=False, n=3, temperature=1.0, seed=3,
                     max_tokens=80)
    assert sum(_check_calls(c, one=True) for c in required.choices) >= 2
    # Cut by max_tokens inside the JSON: finish_reason "length" and no broken call.
    cut = _chat(urls["off"], tool_choice=NAMED_W, max_tokens=4, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None


def test_forced_calls_stream_in_openai_deltas(urls):
    for choice in (NAMED_W, "required"):
        whole = _chat(urls["off"], tool_choice=choice, temperature=0, parallel_tool_calls=False, max_tokens=80)
        chunks = list(_chat(urls["off"], tool_choice=choice, temperature=0, parallel_tool_calls=False, max_tokens=80,
                            stream=True))
        content, calls, finish = _assemble(chunks)
        assert content == "" and finish == whole.choices[0].finish_reason == "tool_calls"
        assert calls == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
        # The arguments arrive in pieces as they are generated, not in one chunk at the end.
        assert sum(bool(ch.choices and ch.choices[0].delta.tool_calls) for ch in chunks) > 3


def test_auto_returns_content_when_the_reply_is_no_call(urls):
    """The demo's replies are no calls: 'auto' gives the same text as 'none' (the tools rendered both times),
    streamed and not, with no tool_calls."""
    plain = _chat(urls["hermes"], tool_choice="none", temperature=0, max_tokens=16)
    auto = _chat(urls["hermes"], temperature=0, max_tokens=16)    # tool_choice defaults to 'auto' with tools
    assert auto.choices[0].message.content == plain.choices[0].message.content
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason == "length"
    content, calls, finish = _assemble(_chat(urls["hermes"], temperature=0, max_tokens=16, stream=True))
    assert (content, calls, finish) == (plain.choices[0].message.content, [], "length")
    no_tools = _chat(urls["hermes"], tools=None, temperature=0, max_tokens=16)
    assert no_tools.usage.prompt_tokens < plain.usage.prompt_tokens    # the tools were rendered


def test_auto_with_llama3_json_turns_call_text_into_tool_calls(urls):
    """A reply made a Llama-style call by response_format, parsed by --tool-call-parser llama3_json."""
    schema = {"type": "object", "properties": {"name": {"enum": ["w"]}, "parameters": W},
              "required": ["name", "parameters"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": schema}}
    whole = _chat(urls["llama3_json"], response_format=fmt, temperature=0, max_tokens=80)
    assert _check_calls(whole.choices[0]) and whole.choices[0].message.tool_calls[0].function.name == "w"
    content, calls, finish = _assemble(_chat(urls["llama3_json"], response_format=fmt, temperature=0, max_tokens=80,
                                             stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert calls == [("w", whole.choices[0].message.tool_calls[0].function.arguments)]


def test_auto_needs_the_server_flag(urls):
    for kw in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(urls["off"], **kw)
        assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in e.value.body["message"]
    # A grammar xgrammar cannot make of a function's parameters is the tools' 400, not response_format's.
    bad = [{"type": "function", "function": {"name": "b", "parameters": {"type": "object", "properties": {
        "x": {"type": "no-such-type"}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(urls["off"], tools=bad, tool_choice="required")
    assert e.value.body["param"] == "tools", e.value.body
    # vLLM's guided decoding beside a forced call: the call's grammar would silently replace it.
    for extra in ({"guided_json": T}, {"structured_outputs": {"regex": "[a-z]+"}}, {"guided_choice": ["a"]}):
        for choice in ("required", NAMED_W):
            with pytest.raises(openai.BadRequestError) as e:
                _chat(urls["off"], tool_choice=choice, extra_body=extra)
            assert e.value.body["param"] == next(iter(extra)), e.value.body
            assert "cannot be combined with tool_choice" in e.value.body["message"]


def test_a_replys_model_dump_and_the_tool_result_are_accepted_and_rendered(urls):
    first = _chat(urls["hermes"], tool_choice=NAMED_W, temperature=0, max_tokens=80)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    history = MSGS + [msg.model_dump(), {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"}]
    for stream in (False, True):
        out = _chat(urls["hermes"], messages=history, temperature=0, max_tokens=8, stream=stream, prediction=None,
                    audio=None, modalities=["text"], parallel_tool_calls=True, store=False)
        if stream:
            assert _assemble(out)[2] in ("stop", "length", "tool_calls")
        else:
            assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # /tokenize renders what the chat route feeds the model: the call and its result are in it.
    tok = httpx.post(urls["hermes"] + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30).json()
    text = httpx.post(urls["hermes"] + "/detokenize", json={"tokens": tok["tokens"]}, timeout=30).json()["prompt"]
    args = json.loads(msg.tool_calls[0].function.arguments)
    assert f"<tool_call>{json.dumps({'name': 'w', 'arguments': args}, ensure_ascii=False)}</tool_call>" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"name": "t"' in text
