"""Load: 50 concurrent streaming clients, a fifth of which hang up mid-stream. The others complete in full,
the aborted requests leave the engine (no request running or waiting, the KV pool back to full, as
/metrics reports), and `tp-overlap bench serve` measures the server."""

import asyncio
import json
import re
import time

import httpx
import pytest

from tp_overlap_plugin.cli.main import main as cli_main
from serving_helpers import ServerProcess

pytestmark = pytest.mark.timeout(180)

N_CLIENTS = 50
N_DISCONNECT = N_CLIENTS // 5
SHORT, LONG = 24, 400


@pytest.fixture(scope="module")
def server():
    # A small KV pool (128 blocks of 16 tokens for 50 clients) so that the run also preempts, and a leak
    # of even a few blocks would be visible.
    with ServerProcess(["--max-model-len", "512", "--max-num-seqs", "64", "--num-kv-blocks", "128",
                        "--no-access-log", "--log-level", "warning"]) as s:
        yield s


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'^(tp_overlap_\w+)(\{[^}]*\})? (\S+)$', line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def _gauge(metrics: dict[str, float], name: str) -> float:
    return metrics[f'tp_overlap_{name}{{model_name="demo"}}']


async def _client(url: str, i: int, disconnect: bool) -> dict:
    body = {"model": "demo", "prompt": f"client {i}: " + "abc " * (i % 7), "max_tokens": LONG if disconnect else SHORT,
            "ignore_eos": True, "temperature": 0.8, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}
    text, chunks, usage, done = "", 0, None, False
    async with httpx.AsyncClient(timeout=120) as c:
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                ev = json.loads(line[6:])
                if ev["choices"]:
                    text += ev["choices"][0]["text"]
                    chunks += 1
                if ev.get("usage"):
                    usage = ev["usage"]
                if disconnect and chunks == 5:
                    break         # leaving the block closes the connection mid-stream
    return {"i": i, "disconnect": disconnect, "done": done, "usage": usage, "chunks": chunks}


def test_concurrent_streams_with_disconnects_free_everything(server):
    before = _metrics(server.url)
    total = _gauge(before, "kv_cache_total_blocks")
    assert _gauge(before, "kv_cache_free_blocks") == total == 128

    async def run():
        return await asyncio.gather(*[_client(server.url, i, i % 5 == 0) for i in range(N_CLIENTS)])

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    stayed = [r for r in results if not r["disconnect"]]
    left = [r for r in results if r["disconnect"]]
    assert len(stayed) == N_CLIENTS - N_DISCONNECT and len(left) == N_DISCONNECT
    for r in stayed:
        assert r["done"] and r["usage"]["completion_tokens"] == SHORT, r
    assert all(not r["done"] and r["chunks"] == 5 for r in left)

    # Aborts are applied by the engine loop between steps; give it a moment, then everything is free.
    deadline = time.monotonic() + 15
    while True:
        m = _metrics(server.url)
        state = {k: _gauge(m, k) for k in ("num_requests_running", "num_requests_waiting", "kv_cache_free_blocks",
                                            "num_requests_in_flight")}
        if state == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_free_blocks": total,
                     "num_requests_in_flight": 0}:
            break
        assert time.monotonic() < deadline, f"engine did not drain after the clients left: {state}"
        time.sleep(0.1)
    assert _gauge(m, "kv_cache_usage_perc") == 0.0
    aborted = m.get('tp_overlap_requests_total{endpoint="completions",finish_reason="abort",model_name="demo"}', 0)
    finished = m.get('tp_overlap_requests_total{endpoint="completions",finish_reason="length",model_name="demo"}', 0)
    # The hung-up requests were aborted, not run to their 400 tokens.
    assert aborted == N_DISCONNECT and finished == N_CLIENTS - N_DISCONNECT, (aborted, finished)
    assert m['tp_overlap_generation_tokens_total{model_name="demo"}'] < (N_CLIENTS - N_DISCONNECT) * SHORT + \
        N_DISCONNECT * LONG / 2
    print(f"{N_CLIENTS} streams in {elapsed:.1f} s")

    # Still serving, and a non-streaming request behaves too.
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200


def test_non_streaming_client_disconnect_aborts(server):
    def running():
        return _gauge(_metrics(server.url), "num_requests_running")

    before_abort = _metrics(server.url).get(
        'tp_overlap_requests_total{endpoint="completions",finish_reason="abort",model_name="demo"}', 0)
    with pytest.raises(httpx.ReadTimeout):
        # 4 x 500 tokens take seconds on a CPU; the client gives up after 0.3 s and closes the connection.
        httpx.post(server.url + "/v1/completions", json={"prompt": "long", "max_tokens": 500, "ignore_eos": True,
                                                          "n": 4, "temperature": 1.0},
                   timeout=httpx.Timeout(10, read=0.3))
    deadline = time.monotonic() + 15
    while running() != 0:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.1)
    after = _metrics(server.url)
    assert after['tp_overlap_requests_total{endpoint="completions",finish_reason="abort",model_name="demo"}'] == \
        before_abort + 4
    assert _gauge(after, "kv_cache_free_blocks") == _gauge(after, "kv_cache_total_blocks")


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_reports_throughput_and_latencies(server, tmp_path, capsys, endpoint):
    out = tmp_path / "bench.json"
    # (chat: the base URL as OpenAI clients take it, with /v1, as in the README's client example)
    base = server.url + ("/v1" if endpoint == "/v1/chat/completions" else "")
    rc = cli_main(["bench", "serve", "--base-url", base, "--endpoint", endpoint, "--num-prompts", "12",
                   "--random-input-len", "32", "--random-output-len", "8", "--max-concurrency", "4",
                   "--request-rate", "40", "--seed", "1", "--result-file", str(out), "--save-detailed", "--ignore-eos",
                   "--percentile-metrics", "ttft,tpot,itl,e2el"])
    assert rc == 0, capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["completed"] == 12 and res["failed"] == 0 and res["model_id"] == "demo" and res["base_url"] == server.url
    assert res["total_output_tokens"] == 12 * 8
    if endpoint == "/v1/completions":
        assert res["total_input_tokens"] == 12 * 32     # token-id prompts: exact lengths
    else:
        assert res["total_input_tokens"] > 12 * 32      # text + chat template
    assert res["request_throughput"] > 0 and res["output_throughput"] > 0
    assert res["total_token_throughput"] > res["output_throughput"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < res[f"median_{m}_ms"] <= res[f"p99_{m}_ms"] + 1e-9, m
        assert res[f"mean_{m}_ms"] > 0
    assert res["mean_e2el_ms"] > res["mean_ttft_ms"]
    # One chunk per token, except that a token decoding to no text yet rides with the next chunk.
    assert len(res["itls"]) == 12 and all(len(itl) <= 7 for itl in res["itls"])
    assert sum(len(itl) for itl in res["itls"]) >= 12 * 7 // 3, [len(itl) for itl in res["itls"]]
    captured = capsys.readouterr()
    assert "Output throughput (tok/s)" in captured.out
    assert "requests: 100%" in captured.err and "12/12" in captured.err    # the progress bar


def test_bench_serve_reports_failures(server, tmp_path, capsys):
    # Over-long prompts are rejected by the server: the benchmark counts them and exits non-zero.
    out = tmp_path / "bench.json"
    rc = cli_main(["bench", "serve", "--base-url", server.url, "--num-prompts", "3", "--random-input-len", "600",
                   "--random-output-len", "4", "--result-file", str(out)])
    assert rc == 1
    res = json.loads(out.read_text())
    assert res["completed"] == 0 and res["failed"] == 3
    assert any("HTTP 400" in e and "max_model_len" in e for e in res["error_samples"])
