"""`tp-overlap bench serve`: load test of a running OpenAI-compatible server, with `vllm bench serve`'s
options and result keys (a script written for one runs against the other).

    tp-overlap serve --model llama-3-8b --load-format dummy --tp 2 &
    tp-overlap bench serve --backend vllm --model llama-3-8b --dataset-name random --random-input-len 1024 \\
        --random-output-len 128 --num-prompts 200 --max-concurrency 32 --ignore-eos \\
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --goodput ttft:500 tpot:50 \\
        --save-result --result-dir bench/results

Every request streams (SSE, `stream_options.include_usage`), so the client sees the tokens arrive; the
datasets are serve_datasets.py's, the measures and JSON keys serve_results.py's. --backend vllm and
openai post to /v1/completions, openai-chat to /v1/chat/completions (or --endpoint).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from typing import Optional

from tp_overlap_plugin import options

from ..user_errors import CliError
from .serve_config import BenchServeConfig
from .serve_datasets import SampleRequest, sample_requests
from .serve_results import RequestResult, build_result, format_report, result_path

_SERVER_HINT = ("start a server first (`tp-overlap serve`, in another terminal), or point --base-url or "
                "--host/--port at one")


def request_body(cfg: BenchServeConfig, model: str, sample: SampleRequest) -> dict:
    body = {"model": model, "max_tokens": sample.output_len, "temperature": cfg.temperature,
            "ignore_eos": cfg.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    return body


async def _one_request(client, url: str, body: dict, headers: dict, timeout: float, t0: float) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(start=start - t0)
    chat = "messages" in body
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    res.ok = not res.error
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    continue
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for ch in chunk.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    # Tokens that decode to no text yet (a partial UTF-8 character) arrive with a later
                    # chunk; the final chunk may carry only the finish reason.
                    if not text and not ch.get("finish_reason"):
                        continue
                    res.text += text or ""
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        if res.ok and (last is None or res.output_tokens == 0):
            res.ok, res.error = False, "the stream ended without any generated token (or no usage report)"
        elif not res.ok and not res.error:
            res.error = "the stream ended without data: [DONE]"
    except Exception as e:   # a benchmark reports failures, it does not stop at the first one
        res.error = f"{type(e).__name__}: {e}"
    return res


def _arrival_gaps(rng: random.Random, n: int, rate: float, burstiness: float) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    # Gamma(shape=k, scale=1/(rate*k)) has mean 1/rate; k=1 is the exponential (Poisson process).
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


def server_root(url: str) -> str:
    """The server's root URL: OpenAI clients take it with `/v1` (the README's client example does), and the
    routes here add that themselves."""
    url = url.rstrip("/")
    return url[:-len("/v1")] if url.endswith("/v1") else url


async def _first_model(client, base: str, headers: dict, ready_timeout: float) -> str:
    """The first model the server lists, or CliError naming what went wrong. With `ready_timeout` > 0 a server
    that does not answer yet is asked again until then (one that is starting up)."""
    import httpx

    deadline = time.monotonic() + ready_timeout
    while True:
        try:
            r = await client.get(base + "/v1/models", headers=headers)
            break
        except httpx.HTTPError as e:
            if time.monotonic() < deadline:
                await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            waited = f" within --ready-check-timeout-sec {ready_timeout:g}" if ready_timeout > 0 else ""
            raise CliError(f"cannot reach the server at {base}{waited}: {type(e).__name__}: {e}", hint=_SERVER_HINT,
                           status=1) from None
    if r.status_code == 401:
        raise CliError(f"{base}/v1/models answered 401 (the server wants an API key)",
                       hint="pass --api-key, or set TP_OVERLAP_API_KEY", status=1)
    if r.status_code == 404:
        raise CliError(f"{base}/v1/models answered 404: that is no OpenAI-compatible server's root URL",
                       hint="point --base-url at the server's root, e.g. http://127.0.0.1:8000", status=1)
    try:
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPStatusError, ValueError, LookupError, TypeError) as e:
        raise CliError(f"{base}/v1/models did not list a model ({type(e).__name__}: {e}; HTTP {r.status_code})",
                       hint="name the model with --model", status=1) from None


def draw_requests(cfg: BenchServeConfig, base: str, model: str, headers: dict) -> tuple[list[SampleRequest], str]:
    """cfg's requests, and the name of the tokenizer that counted the dataset's tokens for the JSON: --tokenizer's
    (transformers), else the server's own /tokenize (the model it serves, whatever its files)."""
    if cfg.dataset_name in ("random", "lognormal"):
        return sample_requests(cfg), cfg.tokenizer or model
    if cfg.tokenizer:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
        except Exception as e:
            raise CliError(f"--tokenizer {cfg.tokenizer}: {type(e).__name__}: {e}") from None
        return sample_requests(cfg, lambda text: len(tok(text, add_special_tokens=False)["input_ids"])), cfg.tokenizer
    import httpx

    with httpx.Client(timeout=cfg.request_timeout) as client:
        def count(text: str) -> int:
            r = client.post(base + "/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False},
                            headers=headers)
            if r.status_code != 200:
                raise CliError(f"{base}/tokenize answered {r.status_code} ({r.text[:200]})",
                               hint="name a tokenizer with --tokenizer", status=1)
            return r.json()["count"]

        return sample_requests(cfg, count), model


async def run_benchmark(cfg: BenchServeConfig) -> dict:
    """Send cfg's requests and measure them: the result dict (serve_results.py) that `bench serve` prints."""
    import httpx
    from tqdm import tqdm

    base = server_root(cfg.base_url or f"http://{cfg.host}:{cfg.port}")
    api_key = cfg.api_key or options.env_api_key(openai_too=True)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = cfg.max_concurrency or cfg.num_prompts
    limits = httpx.Limits(max_connections=max(limit, 1), max_keepalive_connections=max(limit, 1))
    async with httpx.AsyncClient(limits=limits, timeout=cfg.request_timeout) as client:
        model = cfg.model or await _first_model(client, base, headers, cfg.ready_check_timeout_sec)
        if cfg.model and cfg.ready_check_timeout_sec > 0:
            await _first_model(client, base, headers, cfg.ready_check_timeout_sec)
        # (a thread: the dataset's tokens may be counted by the server, over HTTP)
        samples, tokenizer_id = await asyncio.to_thread(draw_requests, cfg, base, model, headers)
        bodies = [request_body(cfg, model, s) for s in samples]
        gaps = _arrival_gaps(random.Random(cfg.seed + 1), len(bodies), cfg.request_rate, cfg.burstiness)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(bodies), desc="requests", unit="req", disable=cfg.disable_tqdm, file=sys.stderr)
        url = base + cfg.route

        async def limited(body, t0):
            try:
                if sem is None:
                    return await _one_request(client, url, body, headers, cfg.request_timeout, t0)
                async with sem:
                    return await _one_request(client, url, body, headers, cfg.request_timeout, t0)
            finally:
                bar.update(1)

        t0 = time.perf_counter()
        tasks = []
        for body, gap in zip(bodies, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(body, t0)))
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    if all(r.error.startswith("ConnectError") for r in results):
        raise CliError(f"every request failed: cannot connect to {base} ({results[0].error})", hint=_SERVER_HINT,
                       status=1)
    return build_result(cfg, results, duration, base, model, tokenizer_id)


def bench_serve_main(cfg: BenchServeConfig) -> int:
    """Run, print the report, write the JSON where asked; exit status 1 when any request failed, so that
    scripts notice."""
    res = asyncio.run(run_benchmark(cfg))
    print(format_report(res, cfg))
    path: Optional[str] = result_path(cfg, res)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
        print(f"results written to {path}")
    return 1 if res["failed"] else 0
