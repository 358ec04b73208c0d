"""An engine that fails turns into a 500 for the request and a 503 on /health, and an unexpected exception
into a JSON 500 on a connection that stays open, while the server stays up; a killed engine-core process
fails every stream and the health check. Bad input fails in the server's process, before it reaches the
engine-core process. (The bad requests themselves: test_server_errors.py.)"""

import functools
import json
import logging
import threading
import time

import httpx
import pytest

from tp_overlap_plugin.serving import AsyncLLM, EngineConfig
from tp_overlap_plugin.serving.entrypoints.openai.api_server import build_app
from serving_helpers import assert_openai_error as _assert_error
from serving_helpers import fail_steps_once_flagged, free_port

pytestmark = pytest.mark.timeout(120)

MAX_LEN = 64


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
