"""Bad requests get OpenAI-style errors with the right status (400, 401, 404; never FastAPI's 422) and the
server keeps answering: hand-written cases (text that is not valid Unicode, empty bodies, wrong content
types included), then fuzzing from the server's own OpenAPI schema. An engine that fails turns into a 500
for the request and a 503 on /health, and an unexpected exception into a JSON 500 on a connection that
stays open, while the server stays up. Bad input fails in the server's process, before it reaches the
engine-core process."""

import functools
import json
import logging
import threading
import time

import httpx
import openai
import pytest

from tp_overlap_plugin.serving import AsyncLLM, EngineConfig
from tp_overlap_plugin.serving.entrypoints.openai.api_server import build_app
from serving_helpers import ServerProcess, fail_steps_once_flagged, free_port

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-key"
MAX_LEN = 64
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--api-key", KEY, "--max-model-len", str(MAX_LEN), "--no-access-log",
                        "--log-level", "warning"]) as s:
        yield s


def _post(server, path, body=None, content=None, headers=AUTH):
    return httpx.post(server.url + path, json=body, content=content, timeout=30,
                      headers={**headers, "Content-Type": "application/json"})


def _assert_error(r, status, *fragments, param=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    for f in fragments:
        assert f in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def _still_serving(server):
    r = _post(server, "/v1/completions", {"model": "demo", "prompt": "ok", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_api_key_required_on_v1_routes(server):
    for headers, what in (({}, "missing API key"), ({"Authorization": "Bearer wrong"}, "invalid API key"),
                          ({"Authorization": KEY}, "invalid API key")):
        _assert_error(_post(server, "/v1/completions", {"prompt": "x"}, headers=headers), 401, what)
        _assert_error(httpx.get(server.url + "/v1/models", headers=headers), 401, what)
        for path in ("/tokenize", "/detokenize"):
            _assert_error(_post(server, path, {"prompt": "x", "tokens": [1]}, headers=headers), 401, what)
    # The key is checked before the body: an unauthenticated client learns nothing about its request.
    _assert_error(_post(server, "/v1/completions", content=b"{not json", headers={}), 401)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == ["demo"]
    _still_serving(server)


BAD_COMPLETIONS = [
    # (body or raw bytes, expected fragments, param)
    (b'{"prompt": "hi", ', ["not valid JSON"], None),
    (b'["prompt", "hi"]', ["JSON object"], None),
    ({"prompt": "hi", "max_tokens": "ten"}, ["max_tokens", "integer"], "max_tokens"),
    ({"prompt": "hi", "max_tokens": 5.5}, ["max_tokens"], "max_tokens"),
    ({"prompt": 12345}, ["prompt must be a string"], "prompt"),
    ({"prompt": [1, "two"]}, ["prompt must be a string"], "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, ["temperature"], "temperature"),
    ({"prompt": "hi", "stream": "yes"}, ["stream"], "stream"),
    ({"max_tokens": 4}, ["missing required parameter 'prompt'"], "prompt"),
    ({"prompt": "hi", "max_tokens": -1}, ["max_tokens", "greater than or equal to 1"], "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, ["max_tokens"], "max_tokens"),
    ({"prompt": "hi", "n": 0}, ["'n'"], "n"),
    ({"prompt": "hi", "temperature": -0.1}, ["temperature"], "temperature"),
    ({"prompt": "hi", "top_p": 0}, ["top_p"], "top_p"),
    ({"prompt": "hi", "logit_bias": {"320": 5}}, ["token id 320 is outside the vocabulary [0, 320)"], "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"-1": 5}}, ["token ids written as strings of digits"], "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1": 101}}, ["must be in [-100, 100]"], "logit_bias"),
    ({"prompt": "hi", "logprobs": 21}, ["'logprobs'", "less than or equal to 20"], "logprobs"),
    ({"prompt": "hi", "presence_penalty": 2.5}, ["'presence_penalty'", "less than or equal to 2"], "presence_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, ["'repetition_penalty'", "greater than 0"], "repetition_penalty"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": 5}}}}, ["JSON schema cannot be used", "properties must be an object"],
     "response_format"),
    ({"prompt": "hi", "response_format": {"type": "json_schema"}}, ["needs a 'json_schema' object"],
     "response_format"),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, ["response_format.type"], "response_format.type"),
    ({"prompt": "hi", "ignore_eos": True, "response_format": {"type": "json_object"}}, ["ignore_eos cannot"], None),
    ({"prompt": "hi", "suffix": "end"}, ["suffix"], "suffix"),
    ({"prompt": "hi", "stop": ""}, ["stop strings must be non-empty"], "stop"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, ["only allowed when stream is true"], None),
    ({"prompt": ""}, ["empty"], "prompt"),
    ({"prompt": []}, ["empty"], "prompt"),
    ({"prompt": [1, 2, 99999]}, ["outside the vocabulary"], "prompt"),
    ({"prompt": "hi", "n": 100, "max_tokens": 2, "stream": False, "user": "u"} | {"prompt": ["a", "b", "c"]},
     ["at most 256"], "n"),
    # JSON escapes of lone surrogates decode to text no tokenizer can encode
    (b'{"prompt": "\\ud800", "max_tokens": 4}', ["'prompt'", "lone surrogate \\ud800"], "prompt"),
    (b'{"prompt": ["ok", "a\\udc00"], "stream": true}', ["'prompt.1'", "not valid Unicode"], "prompt.1"),
    (b'{"prompt": "ok", "stop": ["\\udfff"]}', ["'stop.0'"], "stop.0"),
    (b'{"prompt": "ok", "user": "\\ud83d"}', ["'user'"], "user"),
    (b"", ["the request body is empty"], None),
    # what the JSON parser alone would call "an error parsing the body"
    (b'{"prompt": "caf\xe9"}', ["not valid UTF-8 at byte 15"], None),
    (b'{"prompt": "hi", "x": ' + b"[" * 101 + b"]" * 101 + b"}", ["JSON nesting deeper than 100"], None),
    (b'{"prompt": "hi", "temperature": NaN}', ["temperature must be a finite number"], "temperature"),
    (b'{"prompt": "hi", "top_p": Infinity}', ["top_p must be a finite number"], "top_p"),
    (b'{"prompt": "hi", "logit_bias": {"1": -Infinity}}', ["logit_bias.1 must be a finite number"], "logit_bias.1"),
    # vLLM's extensions, refused where they cannot be honoured
    ({"prompt": "hi", "guided_regex": "[a-"}, ["the regex cannot be used"], "guided_regex"),
    ({"prompt": "hi", "guided_grammar": "root ::= foo"}, ["the grammar cannot be used", "foo"], "guided_grammar"),
    ({"prompt": "hi", "guided_json": "{not json"}, ["not a JSON schema"], "guided_json"),
    ({"prompt": "hi", "guided_choice": []}, ["non-empty list"], "guided_choice"),
    ({"prompt": "hi", "guided_choice": ["a"], "response_format": {"type": "json_object"}},
     ["one structured-output constraint", "guided_choice, response_format"], None),
    ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}, ["exactly one of json"], None),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, ["min_tokens=9 is more than max_tokens=4"], None),
    ({"prompt": "hi", "min_tokens": 2, "guided_choice": ["a"]}, ["min_tokens cannot be combined"], None),
    ({"prompt": "hi", "best_of": 2, "n": 3}, ["best_of=2 is less than n=3"], None),
    ({"prompt": "hi", "best_of": 3, "stream": True}, ["cannot stream"], None),
    ({"prompt": "hi", "prompt_logprobs": 21}, ["'prompt_logprobs'", "less than or equal to 20"], "prompt_logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, ["only supported without streaming"], None),
    ({"prompt": "hi", "request_id": "two words"}, ["printable ASCII"], "request_id"),
]


@pytest.mark.parametrize("body,fragments,param", BAD_COMPLETIONS, ids=range(len(BAD_COMPLETIONS)))
def test_bad_completion_requests_are_400(server, body, fragments, param):
    err = _assert_error(_post_any(server, "/v1/completions", body), 400, *fragments, param=param)
    assert err["type"] == "invalid_request_error"


BAD_CHATS = [
    ({"messages": []}, ["messages"]),
    ({"messages": [{"role": "robot", "content": "hi"}]}, ["role"]),
    ({"messages": [{"role": "user"}]}, ["missing required parameter 'messages.0.content'"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     ["'image_url' are not supported"]),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     ["tool_choice 'auto'", "--enable-auto-tool-choice"]),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     ["'f', which is not among the tools (none given)"]),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, ["'functions'", "as 'tools'"]),
    ({"messages": [{"role": "tool", "content": "x"}]}, ["missing required parameter 'messages.0.tool_call_id'"]),
    ({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"}, ["'reasoning_effort'"]),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, ["top_logprobs needs logprobs=true"]),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     ["less than or equal to 20"]),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "max_completion_tokens": 5}, ["disagree"]),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     ["continue_final_message needs add_generation_prompt=false"]),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}},
     ["chat_template_kwargs may not set tokenize"]),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', ["temperature must be a finite number"]),
    (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', ["'messages.0.content'", "surrogate"]),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800x"}]}], "stream": true}',
     ["'messages.0.content.0.text'"]),
]

BAD_TOKENIZE = [
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}, ["exactly one"]),
    ("/tokenize", {}, ["exactly one"]),
    ("/tokenize", b'{"prompt": "\\ud800"}', ["'prompt'", "surrogate"]),
    ("/tokenize", {"prompt": "hi", "continue_final_message": True}, ["unsupported parameter"]),
    ("/detokenize", {"tokens": [1, 2, 320]}, ["tokens[2] = 320", "outside the vocabulary [0, 320)"]),
    ("/detokenize", {"tokens": [-1]}, ["tokens[0] = -1"]),
    ("/detokenize", {"tokens": "abc"}, ["tokens"]),
]


def _post_any(server, path, body):
    return _post(server, path, content=body) if isinstance(body, bytes) else _post(server, path, body)


@pytest.mark.parametrize("body,fragments", BAD_CHATS, ids=range(len(BAD_CHATS)))
def test_bad_chat_requests_are_400(server, body, fragments):
    _assert_error(_post_any(server, "/v1/chat/completions", body), 400, *fragments)


@pytest.mark.parametrize("path,body,fragments", BAD_TOKENIZE, ids=range(len(BAD_TOKENIZE)))
def test_bad_tokenize_requests_are_400(server, path, body, fragments):
    _assert_error(_post_any(server, path, body), 400, *fragments)


def test_json_body_without_json_content_type_names_the_header(server):
    body = b'{"prompt": "hi", "max_tokens": 2}'
    # curl -d sends form encoding unless told otherwise
    for ctype in ("application/x-www-form-urlencoded", "text/plain"):
        r = httpx.post(server.url + "/v1/completions", content=body, headers={**AUTH, "Content-Type": ctype})
        _assert_error(r, 400, f"sent as '{ctype}'", "Content-Type: application/json")
    # No content type at all: older FastAPI read such a body as JSON; with strict_content_type (the default
    # since, against cross-site requests) it does not.
    r = httpx.post(server.url + "/v1/completions", content=body, headers=AUTH)
    if r.status_code != 200:
        _assert_error(r, 400, "sent without a Content-Type header", "Content-Type: application/json")


def test_context_limits_are_named(server):
    long_prompt = "x" * 100          # byte tokenizer: 101 tokens with BOS, over max_model_len=64
    for stream in (False, True):
        err = _assert_error(_post(server, "/v1/completions", {"prompt": long_prompt, "stream": stream}), 400,
                            "64 tokens (max_model_len)", "101 prompt tokens", "max_tokens=16",
                            "shorten the prompt to at most 48 tokens", param="prompt")
        assert err["code"] == "context_length_exceeded"
    # (issue 40: a prompt longer than the context named max_tokens, and said to lower it)
    _assert_error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 80}],
                                                         "max_tokens": 4}),
                  400, "shorten the messages to at most 60 tokens", param="messages")
    _assert_error(_post(server, "/v1/completions", {"prompt": "x" * 40, "max_tokens": 30}), 400,
                  "needs 71", "41 prompt tokens + max_tokens=30", param="max_tokens")
    ok = _post(server, "/v1/completions", {"prompt": "x" * 40, "max_tokens": 23, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == 64
    _assert_error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 80}]}),
                  400, "no room is left")
    _assert_error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 30}],
                                                         "max_completion_tokens": 40}),
                  400, "max_completion_tokens=40", param="max_completion_tokens")
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        with pytest.raises(openai.BadRequestError, match="max_model_len"):
            c.completions.create(model="demo", prompt=long_prompt)
    _still_serving(server)


def test_unknown_model_and_route_are_404(server):
    err = _assert_error(_post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404, "'gpt-9'", "'demo'")
    assert err["code"] == "model_not_found"
    _assert_error(_post(server, "/v1/chat/completions",
                        {"model": "nope", "messages": [{"role": "user", "content": "x"}], "stream": True}), 404)
    _assert_error(httpx.get(server.url + "/v1/nothing-here", headers=AUTH), 404)
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="gpt-9", prompt="hi")
    _still_serving(server)


def test_errors_are_counted_and_server_still_answers(server):
    metrics = httpx.get(server.url + "/metrics").text
    line = next(l for l in metrics.splitlines()
                if l.startswith('tp_overlap_http_responses_total{route="/v1/completions",status="400"}'))
    assert float(line.split()[-1]) >= len(BAD_COMPLETIONS)
    assert 'status="422"' not in metrics
    _still_serving(server)
    assert httpx.get(server.url + "/health").status_code == 200


# ---- fuzzing from the server's own OpenAPI schema --------------------------------------------------
# Schema-valid (positive) and schema-violating (negative) requests to every route, generated by
# schemathesis, reproducibly (derandomized): FUZZ_CASES per mode and route group, 245 requests in all
# (2 x 60 generation, 2 x 60 tokenize, 5 to the other routes). At 100 each the completions case took 9 s
# alone on 2 cores but 63-84 s beside another xdist worker's file (bench/notes/ci.md).
FUZZ_CASES = 60
# Positive cases come from a copy of the schema narrowed (the server's own limits are tested above) so
# that most of them pass the server's checks and generate, cheaply: short texts and lists, ids inside
# the byte vocabulary, a few tokens per request, the served model's name.
FUZZ_LIMITS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}
# schemathesis reads an event stream up to `max-stream-events` events (20 by default), then hangs up and
# hands over what it read; the checks below want every stream's end. The longest stream here (chat: n=2
# choices of up to MAX_LEN tokens) is far shorter than this.
FUZZ_MAX_STREAM_EVENTS = 10_000
FUZZ_REQUESTS = ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest",
                 "SystemMessage", "UserMessage", "AssistantMessage", "ToolMessage", "FunctionMessage",
                 "TextContentPart", "RefusalContentPart", "ToolCallParam", "FunctionCallParam", "ChatTool",
                 "FunctionDefinition", "StreamOptions")


def _narrow(node, field: str) -> None:
    """Narrow the schema of request field `field` in place (its union branches and items too)."""
    if isinstance(node, list):
        for x in node:
            _narrow(x, field)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind == "string" and "enum" not in node and "const" not in node:
        node.update(minLength=1, maxLength=12)      # non-empty: stop strings must be
    elif kind == "integer":
        node.update(minimum=max(node.get("minimum", 0), 0),
                    maximum=min(node.get("maximum", 255), FUZZ_LIMITS.get(field, 255)))
    elif kind == "array":
        node.update(minItems=max(node.get("minItems", 0), 1), maxItems=3)
    for value in node.values():
        _narrow(value, field)


@pytest.fixture(scope="module")
def fuzz_schemas(server):
    """(the server's schema, the narrowed copy for positive cases)"""
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.config import SchemathesisConfig

    config = SchemathesisConfig.from_dict({"max-stream-events": FUZZ_MAX_STREAM_EVENTS})
    doc = httpx.get(server.url + "/openapi.json").json()
    narrow = json.loads(json.dumps(doc))
    for name in FUZZ_REQUESTS:
        schema = narrow["components"]["schemas"][name]
        for field, prop in schema["properties"].items():
            _narrow(prop, field)
        # The server ignores fields it does not know (as vLLM does): positive cases send none, which would
        # only make every case a slow generation.
        schema["additionalProperties"] = False
        if "model" in schema["properties"]:
            schema["properties"]["model"] = {"enum": ["demo", None]}
        if "tools" in schema["properties"]:
            # Rendered tools alone pass this server's context (MAX_LEN), and 'auto' needs a flag it lacks:
            # positive cases send none (test_server_tools.py serves them; negative cases still send any).
            schema["properties"]["tools"] = {"type": "null"}
    # "exactly one of prompt and messages", which the server's schema does not say
    narrow["components"]["schemas"]["TokenizeRequest"]["oneOf"] = [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]
    return schemathesis.openapi.from_dict(doc, config=config), schemathesis.openapi.from_dict(narrow, config=config)


def _fuzz(schema, server, mode, path_regex) -> dict:
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.specs.openapi.checks import response_schema_conformance

    strategy = schema.include(path_regex=path_regex).as_strategy(generation_mode=mode)
    seen = {"calls": 0, "2xx": 0, "4xx": 0}

    @settings(max_examples=FUZZ_CASES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        resp = case.call(base_url=server.url, headers=AUTH, timeout=60)
        seen["calls"] += 1
        what = f"{case.method} {case.path} {case.body!r} -> {resp.status_code} {resp.text[:500]}"
        assert resp.status_code < 500, what
        ctype = resp.headers.get("content-type") or [""]     # schemathesis keeps every value of a header
        ctype = ctype if isinstance(ctype, str) else ctype[0]
        if resp.status_code >= 400:
            seen["4xx"] += 1
            body = resp.json() if case.method != "HEAD" else None
            if body is not None:     # OpenAI's error shape, whatever went wrong
                assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, what
                assert isinstance(body["error"]["message"], str) and body["error"]["message"], what
            return
        seen["2xx"] += 1
        if ctype.startswith("application/json"):
            case.validate_response(resp, checks=[response_schema_conformance])
        elif ctype.startswith("text/event-stream"):
            assert resp.text.rstrip().endswith("data: [DONE]"), what

    check()
    print(f"fuzz {path_regex} {mode.value}: {seen}")
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("routes", [r"^/v1/(chat/)?completions$", r"^/(de)?tokenize$"])
def test_fuzz_no_5xx_and_openai_errors(fuzz_schemas, server, mode, routes):
    from schemathesis import GenerationMode

    full, narrow = fuzz_schemas
    if mode == "positive":
        seen = _fuzz(narrow, server, GenerationMode.POSITIVE, routes)
        # A server that rejected everything would pass the checks too. (Schema-valid cases the server does
        # reject: integral floats such as `"n": 2.0` are JSON-schema integers, which the server's strict
        # types refuse (protocol.py); and cross-field rules like max_tokens agreeing with max_completion_tokens.)
        assert seen["2xx"] >= seen["calls"] // 3, seen
    else:
        # Violations of the server's own schema: every one a 400 in OpenAI's shape.
        seen = _fuzz(full, server, GenerationMode.NEGATIVE, routes)
        assert seen["4xx"] == seen["calls"], seen
    assert seen["calls"] >= FUZZ_CASES // 2, seen
    _still_serving(server)


def test_fuzz_client_reads_streams_to_the_end(fuzz_schemas, server):
    """The fuzz client gets a long stream whole (it used to hang up after 20 events: the stream then lacked
    its last chunks and [DONE], and the server, seeing a disconnect, aborted the request as it should)."""
    op = fuzz_schemas[0]["/v1/completions"]["POST"]
    # logprobs: a chunk for every token, even one that ends inside a UTF-8 character; no EOS: 3 x 12 of them
    body = {"model": "demo", "prompt": ["a", "bc", "d"], "max_tokens": 12, "ignore_eos": True, "logprobs": 0,
            "stream": True}
    resp = op.Case(body=body).call(base_url=server.url, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    events = [e for e in resp.text.split("\n\n") if e.strip()]
    assert not resp.stream_cut_short and len(events) == 3 * 12 + 1 and events[-1] == "data: [DONE]", resp.text[-500:]


def test_fuzz_other_routes(fuzz_schemas, server):
    from schemathesis import GenerationMode

    seen = _fuzz(fuzz_schemas[0], server, GenerationMode.POSITIVE, r"^/(v1/models|health|metrics|version)$")
    assert seen["calls"] >= 5 and seen["2xx"] == seen["calls"], seen
    m = httpx.get(server.url + "/metrics").text
    assert 'status="5' not in m, [line for line in m.splitlines() if 'status="5' in line]
    assert 'tp_overlap_num_requests_running{model_name="demo"} 0.0' in m
    _still_serving(server)


# ---- engine failure (in-process server, so the test can break the engine) ---------------------------
@pytest.fixture(scope="module")
def inproc_server(tmp_path_factory):
    """An AsyncLLM behind uvicorn in this process. Shared by the tests below; the last one breaks the engine
    (its core process fails every step once the file `engine.fault_flag` exists)."""
    import uvicorn

    flag = tmp_path_factory.mktemp("fault") / "flag"
    engine = AsyncLLM(EngineConfig(model="demo", max_model_len=MAX_LEN, show_progress=False),
                      core_setup=functools.partial(fail_steps_once_flagged, str(flag)))
    engine.fault_flag = flag
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, "demo"), host="127.0.0.1", port=port,
                                        log_level="warning", lifespan="off"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline and t.is_alive(), "in-process server did not start"
            time.sleep(0.05)
        yield engine, url
    finally:
        srv.should_exit = True
        t.join(30)
        engine.shutdown()


def _data(lines) -> list[str]:
    """The data fields of SSE lines."""
    return [line[6:] for line in lines if line.startswith("data: ")]


def test_unexpected_exception_is_a_json_500_and_the_connection_stays_open(inproc_server, monkeypatch):
    import http.client
    import json

    from tp_overlap_plugin.serving.entrypoints.openai.server_logprobs import LogprobFormatter

    _, url = inproc_server

    def broken(*args, **kw):
        raise RuntimeError("injected bug \udcff")    # text that cannot be encoded must not break the 500

    # logprobs=0 formats log-probabilities in the handler: before the response without streaming, after
    # the status line (mid-stream) with it.
    monkeypatch.setattr(LogprobFormatter, "completion", broken)
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    try:
        def call(method, path, body=None):
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.getheader("content-type"), r.read().decode()

        base = {"model": "demo", "prompt": "hello", "max_tokens": 3, "logprobs": 0}
        status, ctype, text = call("POST", "/v1/completions", base)
        assert status == 500 and ctype == "application/json", text
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"} and "injected bug" in err["message"]
        # The same keep-alive connection serves the next request (uvicorn used to drop it: ECONNRESET).
        assert call("GET", "/v1/models")[0] == 200
        status, ctype, text = call("POST", "/v1/completions", {**base, "stream": True})
        assert status == 200 and ctype.startswith("text/event-stream")
        events = _data(text.splitlines())
        assert events[-1] == "[DONE]" and "injected bug" in json.loads(events[-2])["error"]["message"], text
        assert call("HEAD", "/health")[0] == 200
        status, _, text = call("POST", "/v1/completions", {"model": "demo", "prompt": "hello", "max_tokens": 3})
        assert status == 200, text
    finally:
        conn.close()


def test_a_stream_that_ends_early_is_logged_with_its_id(inproc_server, monkeypatch, caplog):
    """A stream cut by an exception after its first chunk ends with an error event and [DONE], and the log
    names the stream and has the traceback; a client that hangs up mid-stream is logged with the id too."""
    from tp_overlap_plugin.serving.entrypoints.openai.server_logprobs import LogprobFormatter

    _, url = inproc_server
    caplog.set_level(logging.INFO, logger="tp_overlap.server")
    real, calls = LogprobFormatter.completion, []

    def second_chunk_fails(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected bug")
        return real(*args, **kw)

    monkeypatch.setattr(LogprobFormatter, "completion", second_chunk_fails)
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4, "ignore_eos": True, "logprobs": 0, "stream": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    events = _data(r.text.splitlines())
    assert r.status_code == 200 and len(events) == 3 and events[-1] == "[DONE]", r.text
    rid = json.loads(events[0])["id"]
    assert "injected bug" in json.loads(events[1])["error"]["message"], r.text
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert any(rec.levelno == logging.ERROR and rec.exc_info for rec in logged), caplog.text
    monkeypatch.undo()

    with httpx.stream("POST", url + "/v1/completions", json={**body, "max_tokens": MAX_LEN - 8}, timeout=30) as r:
        first = next(line for line in r.iter_lines() if line)    # then hang up
    rid = json.loads(first.removeprefix("data: "))["id"]
    deadline = time.monotonic() + 10
    while not any(rid in rec.getMessage() and "client disconnected" in rec.getMessage() for rec in caplog.records):
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.02)


def test_bad_requests_never_reach_the_engine_core(inproc_server, monkeypatch):
    engine, url = inproc_server
    sent = []
    real_send = engine.core.send
    from tp_overlap_plugin.serving.engine.messages import AddRequest

    monkeypatch.setattr(engine.core, "send", lambda msg: (sent.append(type(msg)), real_send(msg)))
    bad = [({"prompt": [5, 10 ** 6]}, "outside the vocabulary"),
           ({"prompt": "x" * (MAX_LEN + 5)}, "max_model_len"),
           ({"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
           ({"prompt": "hi", "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}},
            "schema")]
    for extra, fragment in bad:
        r = httpx.post(url + "/v1/completions", json={"model": "demo", "max_tokens": 2, **extra}, timeout=30)
        assert r.status_code == 400 and fragment in r.text, (extra, r.text)
    assert sent == [], "a rejected request travelled to the engine core"
    r = httpx.post(url + "/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and sent == [AddRequest], (r.text, sent)


def test_engine_failure_is_500_and_health_turns_503(inproc_server):
    engine, url = inproc_server
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4}
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert httpx.get(url + "/health").status_code == 200

    engine.fault_flag.touch()
    _assert_error(httpx.post(url + "/v1/completions", json=body, timeout=30), 500, "injected device fault")
    _assert_error(httpx.get(url + "/health"), 503)
    # The server itself is up: other routes answer, and new requests get a clear 500, not a hang.
    assert httpx.get(url + "/v1/models").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    _assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                 "stream": True}, timeout=30), 500, "engine")
    assert "tp_overlap_num_requests_running" in httpx.get(url + "/metrics").text


# ---- a dead engine-core process ---------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_killed_engine_core_fails_every_stream_and_the_health_check():
    """The engine-core process (TP=2: it and the rank it spawned) dies under a running stream: the stream
    ends with an error that says so within seconds, /health turns 503, new requests are a clear 500
    rather than a hang, and no process is left running."""
    import asyncio
    import os
    import signal

    from tp_overlap_plugin.serving import SamplingParams
    from serving_helpers import process_running

    eng = AsyncLLM(EngineConfig(model="demo", block_size=4, max_model_len=MAX_LEN, num_kv_blocks=64,
                                show_progress=False, tensor_parallel_size=2, dist_timeout_s=30))
    core, ranks = eng.core.pid, eng.core.info.worker_pids
    assert len(ranks) == 1 and process_running(core) and process_running(ranks[0])
    app = build_app(eng, "demo")

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://core") as http:
            assert (await http.get("/health")).status_code == 200
            agen = eng.generate("doomed", SamplingParams(max_tokens=50, ignore_eos=True), "k")
            await agen.__anext__()
            os.kill(core, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=r"the engine loop died: .*engine core process .* died: "
                                                   r"killed by SIGKILL"):
                async for _ in agen:
                    pass
            waited = time.monotonic() - t0
            _assert_error(await http.get("/health"), 503)
            r = await http.post("/v1/completions", json={"model": "demo", "prompt": "after", "max_tokens": 2})
            _assert_error(r, 500, "engine", "killed by SIGKILL")
            return waited

    try:
        waited = asyncio.run(asyncio.wait_for(main(), 30))
        print(f"the stream failed {waited * 1e3:.1f} ms after the kill")
        assert waited < 5, waited
        deadline = time.monotonic() + 10
        while process_running(ranks[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_running(ranks[0]), "the killed core's TP rank outlived it"
    finally:
        t0 = time.monotonic()
        eng.shutdown()
        assert time.monotonic() - t0 < 5, "shutting down a dead core must not wait for it"
