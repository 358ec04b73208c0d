"""Bad requests get OpenAI-style errors with the right status (400, 401, 404; never FastAPI's 422) and the
server keeps answering; an engine that fails turns into a 500 for the request and a 503 on /health,
while the server stays up."""

import threading
import time

import httpx
import openai
import pytest

from tp_overlap_plugin.serving import AsyncLLM, EngineConfig
from tp_overlap_plugin.serving.api_server import build_app
from tp_overlap_plugin.serving.testing import ServerProcess, free_port

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
    ({"prompt": "hi", "best_of": 3}, ["best_of=3"], None),
    ({"prompt": "hi", "suffix": "end"}, ["suffix"], "suffix"),
    ({"prompt": "hi", "stop": ""}, ["stop strings must be non-empty"], "stop"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, ["only allowed when stream is true"], None),
    ({"prompt": ""}, ["empty"], "prompt"),
    ({"prompt": []}, ["empty"], "prompt"),
    ({"prompt": [1, 2, 99999]}, ["outside the vocabulary"], "prompt"),
    ({"prompt": "hi", "n": 100, "max_tokens": 2, "stream": False, "user": "u"} | {"prompt": ["a", "b", "c"]},
     ["at most 256"], "n"),
]


@pytest.mark.parametrize("body,fragments,param", BAD_COMPLETIONS, ids=range(len(BAD_COMPLETIONS)))
def test_bad_completion_requests_are_400(server, body, fragments, param):
    if isinstance(body, bytes):
        r = _post(server, "/v1/completions", content=body)
    else:
        r = _post(server, "/v1/completions", body)
    err = _assert_error(r, 400, *fragments, param=param)
    assert err["type"] == "invalid_request_error"


BAD_CHATS = [
    ({"messages": []}, ["messages"]),
    ({"messages": [{"role": "robot", "content": "hi"}]}, ["role"]),
    ({"messages": [{"role": "user"}]}, ["missing required parameter 'messages.0.content'"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     ["'image_url' are not supported"]),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, ["unsupported parameter 'tools'"]),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, ["top_logprobs needs logprobs=true"]),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     ["less than or equal to 20"]),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "max_completion_tokens": 5}, ["disagree"]),
]


@pytest.mark.parametrize("body,fragments", BAD_CHATS, ids=range(len(BAD_CHATS)))
def test_bad_chat_requests_are_400(server, body, fragments):
    _assert_error(_post(server, "/v1/chat/completions", body), 400, *fragments)


def test_context_limits_are_named(server):
    long_prompt = "x" * 100          # byte tokenizer: 101 tokens with BOS, over max_model_len=64
    for stream in (False, True):
        err = _assert_error(_post(server, "/v1/completions", {"prompt": long_prompt, "stream": stream}), 400,
                            "64 tokens (max_model_len)", "101 prompt tokens", "max_tokens=16")
        assert err["code"] == "context_length_exceeded"
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


# ---- engine failure (in-process server, so the test can break the engine) ---------------------------
@pytest.fixture
def inproc_server():
    import uvicorn

    engine = AsyncLLM(EngineConfig(model="demo", max_model_len=MAX_LEN, show_progress=False))
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


def test_engine_failure_is_500_and_health_turns_503(inproc_server):
    engine, url = inproc_server
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4}
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert httpx.get(url + "/health").status_code == 200

    def broken_step(step):
        raise RuntimeError("injected device fault")

    engine.engine.runner.execute = broken_step
    _assert_error(httpx.post(url + "/v1/completions", json=body, timeout=30), 500, "injected device fault")
    _assert_error(httpx.get(url + "/health"), 503)
    # The server itself is up: other routes answer, and new requests get a clear 500, not a hang.
    assert httpx.get(url + "/v1/models").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    _assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                 "stream": True}, timeout=30), 500, "engine")
    assert "tp_overlap_num_requests_running" in httpx.get(url + "/metrics").text
