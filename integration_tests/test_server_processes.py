"""The server's processes: TP=2 serves the same greedy text as TP=1 (the offline engine, which
test_server_openai.py holds the TP=1 server to), under torchrun too; SIGTERM finishes what is in flight
and stops the workers; SIGINT drains, a second one aborts; a killed server takes its engine core and
ranks along. Real `tp-overlap serve` processes on 127.0.0.1 with the demo model."""

import json
import os
import signal
import sys
import threading
import time

import httpx
import openai
import pytest

from tp_overlap_plugin.serving import LLM, EngineConfig, SamplingParams
from serving_helpers import DEMO_MAX_LEN, DEMO_PROMPTS, DEMO_SERVER_ARGS, ServerProcess, free_port
from serving_helpers import greedy_completion as _greedy

pytestmark = pytest.mark.timeout(180)

MAX_LEN, ARGS, PROMPTS = DEMO_MAX_LEN, DEMO_SERVER_ARGS, DEMO_PROMPTS


@pytest.fixture(scope="module")
def offline():
    with LLM(EngineConfig(model="demo", max_model_len=MAX_LEN, show_progress=False)) as llm:
        yield llm


def _offline_greedy(offline, prompt, n_tokens):
    return offline.generate([prompt], SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True))[0]


@pytest.fixture(scope="module")
def server_tp2():
    with ServerProcess(ARGS + ["--tp", "2"]) as s:
        yield s


def test_tp2_serves_the_same_greedy_text(offline, server_tp2):
    with openai.OpenAI(base_url=server_tp2.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c2:
        for p in PROMPTS:
            a, b = _offline_greedy(offline, p, 32), _greedy(c2, p, n_tokens=32)
            assert a.outputs[0].text == b.choices[0].text
            assert (len(a.prompt_token_ids), 32) == (b.usage.prompt_tokens, b.usage.completion_tokens)
        msgs = [{"role": "user", "content": "Tell me about tensors."}]
        ref = offline.chat(msgs, SamplingParams(temperature=0, max_tokens=16))[0]
        assert ref.outputs[0].text == c2.chat.completions.create(model="demo", messages=msgs, max_tokens=16,
                                                                 temperature=0).choices[0].message.content


def _group_members(pgid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    pids.append(int(d))
            except ProcessLookupError:
                pass
    return pids


def test_sigterm_finishes_in_flight_stream_then_stops_workers(server_tp2):
    pgid = server_tp2.proc.pid
    assert len(_group_members(pgid)) >= 2, "the TP=2 server should have a worker process"
    received: list[str] = []
    done = threading.Event()

    def stream():
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 64, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server_tp2.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    received.append(line)
                    if len(received) == 3:
                        done.set()
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    assert done.wait(30), "the stream did not start"
    server_tp2.proc.send_signal(signal.SIGTERM)
    t.join(60)
    rc = server_tp2.proc.wait(timeout=60)
    assert rc == 0, server_tp2.log_tail()
    # The in-flight request finished (64 tokens and [DONE]) before the server went away.
    assert received[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in "".join(received)
    deadline = time.monotonic() + 20
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group_members(pgid) == [], "TP worker processes outlived the server"


def test_a_killed_server_takes_its_engine_core_and_ranks_along():
    # SIGKILL gives the server no chance to stop anything: its engine-core process sees its request
    # pipe close, stops its engine (and the TP rank it spawned) and exits; nothing holds the device.
    with ServerProcess(ARGS + ["--tp", "2"]) as srv:
        pgid = srv.proc.pid
        assert len(_group_members(pgid)) >= 3, "server, engine core, one TP rank (and a resource tracker)"
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _group_members(pgid) == [], "the engine core or its rank outlived the killed server"


class _Stream(threading.Thread):
    """A long completion stream read on a thread: its SSE data lines and when the last one came."""

    def __init__(self, url: str, stream: bool = True):
        super().__init__(daemon=True)
        self.url, self.stream = url, stream
        self.lines: list[str] = []
        self.started = threading.Event()
        self.ended_at: float = 0.0
        self.response = None

    def run(self):
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "stream": self.stream}
        try:
            if self.stream:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line:
                            self.lines.append(line)
                            self.started.set()
            else:
                self.started.set()
                self.response = httpx.post(self.url + "/v1/completions", json=body, timeout=60)
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def chunks(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.lines if line.startswith("data: {")]


def _refused_while_draining(url: str) -> None:
    """New requests (a new connection, or /health) get a 503 in OpenAI's shape that says why."""
    deadline = time.monotonic() + 20
    while True:
        r = httpx.post(url + "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2}, timeout=10)
        if r.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert "shutting down" in err["message"] and err["type"] == "service_unavailable_error", err
    assert httpx.get(url + "/health", timeout=10).status_code == 503


def _ends_with_abort(stream: _Stream) -> None:
    assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
    finishes = [c["choices"][0]["finish_reason"] for c in stream.chunks() if c["choices"]]
    assert finishes[-1] == "abort" and finishes[:-1] == [None] * (len(finishes) - 1), finishes[-3:]


def test_first_sigint_drains_then_aborts_each_stream_with_a_final_chunk():
    # A stream far longer than --shutdown-timeout: after SIGINT new requests get a 503, the stream runs on for
    # the grace period, then ends with a finish_reason "abort" chunk and [DONE], and the server exits.
    with ServerProcess(ARGS + ["--max-model-len", "2048", "--shutdown-timeout", "3", "--log-level", "info"]) as srv:
        stream = _Stream(srv.url)
        stream.start()
        assert stream.started.wait(30)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        _refused_while_draining(srv.url)
        stream.join(30)
        rc = srv.proc.wait(timeout=30)
        log = srv.log_tail(100)
        assert rc == 0, log
        assert stream.ended_at - t0 >= 2.5, "aborted before --shutdown-timeout was over"
        _ends_with_abort(stream)
        assert "--shutdown-timeout (3 s) is over: aborting the 1 request in flight" in log and "engine shut down" in log
        assert "Traceback" not in log and "without completing response" not in log, log


def test_second_sigint_aborts_at_once():
    with ServerProcess(ARGS + ["--max-model-len", "2048", "--shutdown-timeout", "120", "--log-level", "info"]) as srv:
        streams = [_Stream(srv.url), _Stream(srv.url, stream=False)]
        for s in streams:
            s.start()
            assert s.started.wait(30)
        deadline = time.monotonic() + 30
        while 'tp_overlap_num_requests_running{model_name="demo"} 2.0' not in httpx.get(srv.url + "/metrics").text:
            assert time.monotonic() < deadline, "the non-streaming request did not start"
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGINT)
        _refused_while_draining(srv.url)
        time.sleep(1)
        assert streams[0].is_alive() and streams[1].is_alive(), "the first SIGINT must let requests run on"
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        for s in streams:
            s.join(30)
        rc = srv.proc.wait(timeout=30)
        log = srv.log_tail(100)
        assert rc == 0 and time.monotonic() - t0 < 20, log
        _ends_with_abort(streams[0])
        r = streams[1].response
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort", r.text
        assert "a second signal: aborting the 2 requests in flight" in log and "Traceback" not in log, log


def test_torchrun_launch_serves_the_same_text(offline):
    # Under torchrun every rank runs `tp-overlap serve`; rank 0 serves HTTP, rank 1 serves its steps.
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.fail(f"torchrun not found next to {sys.executable}")
    with ServerProcess(ARGS + ["--tp", "2", "--log-level", "info"],
                       launcher=[torchrun, "--nproc-per-node", "2", "--master-port", str(free_port())]) as srv:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c2:
            for p in PROMPTS[:2]:
                assert _offline_greedy(offline, p, 16).outputs[0].text == _greedy(c2, p, n_tokens=16).choices[0].text
        pgid = srv.proc.pid
        srv.proc.send_signal(signal.SIGTERM)      # torchrun forwards it to both ranks
        srv.proc.wait(timeout=60)
        deadline = time.monotonic() + 20
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group_members(pgid) == []
        log = srv.log_tail(200)
        # Rank 1 waited for rank 0's stop instead of dying mid-collective.
        assert "engine shut down" in log and "[rank1]: Traceback" not in log, log
