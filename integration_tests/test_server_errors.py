"""Bad requests get OpenAI-style errors with the right status (400, 401, 404; never FastAPI's 422) and the
server keeps answering: hand-written cases (text that is not valid Unicode, empty bodies, wrong content
types included), then fuzzing from the server's own OpenAPI schema. (A failing engine, and bad input that
never reaches it: test_server_engine_failure.py.)"""

import json
import re

import httpx
import openai
import pytest

from serving_helpers import ServerProcess
from serving_helpers import assert_openai_error as _assert_error

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
# schemathesis, reproducibly (derandomized): FUZZ_CASES per mode and route group, 125 requests in all
# (2 x 30 generation, 2 x 30 tokenize, 5 to the other routes), every operation of a group among them (the
# test asserts it). At 60 each the positive completions group took 52 s beside another xdist worker's file
# (bench/notes/ci.md); the server's limits themselves are the hand-written cases above.
FUZZ_CASES = 30
# Positive cases come from a copy of the schema narrowed (the server's own limits are tested above) so
# that most of them pass the server's checks and generate, cheaply: short texts and lists, ids inside
# the byte vocabulary, a few tokens per request, the served model's name.
FUZZ_LIMITS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}
# schemathesis reads an event stream up to `max-stream-events` events (20 by default), then hangs up and
# hands over what it read; the checks below want every stream's end. The longest stream here (chat: n=2
# choices of up to MAX_LEN tokens) is far shorter than this.
FUZZ_MAX_STREAM_EVENTS = 10_000
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
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
    seen = {"calls": 0, "2xx": 0, "4xx": 0, "operations": set()}

    @settings(max_examples=FUZZ_CASES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        resp = case.call(base_url=server.url, headers=AUTH, timeout=60)
        seen["calls"] += 1
        seen["operations"].add(f"{case.method} {case.path}")
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
    # fewer cases must still reach every operation of the group (the strategy draws the operation too)
    paths = schema.raw_schema["paths"]
    assert seen["operations"] == {f"{method.upper()} {path}" for path in paths if re.search(path_regex, path)
                                  for method in paths[path] if method in HTTP_METHODS}, seen
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
