"""`tp-overlap bench serve`: load test of a running OpenAI-compatible server.

    tp-overlap serve --model llama-3-8b --load-format dummy --tp 2 &
    tp-overlap bench serve --num-prompts 200 --random-input-len 1024 --random-output-len 128 \\
        --max-concurrency 32 --request-rate inf --result-file bench/results/serve-tp2.json

Every request streams (SSE, `stream_options.include_usage`), so the client sees the tokens arrive:
TTFT is the time to the first chunk of generated text, ITL the gaps between later chunks (a token that
decodes to no text yet, such as part of a UTF-8 character, arrives with the next one), TPOT a request's
(latency - TTFT) / (output tokens - 1), E2EL its whole latency. Token counts come from the server's usage
report, not from client-side tokenization.

Dataset `random`: /v1/completions prompts are token ids drawn uniformly from [0, --random-vocab-size),
so the input length is exact for any tokenizer; /v1/chat/completions prompts are random lower-case words
of about --random-input-len characters (the server's count is what is reported). Input and output lengths
are drawn uniformly from [len * (1 - ratio), len * (1 + ratio)].

Dataset `lognormal`: the same prompts, with input and output lengths drawn from lognormal distributions
whose medians are --random-input-len / --random-output-len (serving/benchmarks/workloads.py): many short requests
and a long tail, as in ShareGPT-style serving sets, without downloading one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from tp_overlap_plugin import options

from ..args import CliError
from .workloads import lognormal_lengths


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default=None,
                   help="server URL, e.g. http://10.0.0.5:8000 (or the OpenAI client's http://10.0.0.5:8000/v1; "
                        "default: --host/--port)")
    g.add_argument("--host", default="127.0.0.1", help="server host, when no --base-url")
    g.add_argument("--port", type=int, default=8000, help="server port, when no --base-url")
    g.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                   help="the route every request goes to")
    g.add_argument("--model", default=None, help="model name to send (default: the first one /v1/models lists)")
    # Read from the environment at run time, not as the option's default: --help would print the key.
    g.add_argument("--api-key", default=None, help="bearer token (default: $TP_OVERLAP_API_KEY, else $OPENAI_API_KEY)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=["random", "lognormal"],
                   help="random: uniform lengths around --random-input-len/--random-output-len; lognormal: "
                        "long-tailed lengths with those medians, like a ShareGPT-style set, made in code")
    d.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    d.add_argument("--random-input-len", type=int, default=128,
                   help="prompt length: token ids for /v1/completions, characters for chat")
    d.add_argument("--random-output-len", type=int, default=64, help="max_tokens of a request")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are drawn from [len*(1-r), len*(1+r)]; 0: fixed")
    d.add_argument("--random-vocab-size", type=int, default=256,
                   help="completion prompts use token ids in [0, N); 256 fits every supported tokenizer")
    d.add_argument("--lognormal-sigma", type=float, default=1.0, help="lognormal: the lengths' shape")
    d.add_argument("--lognormal-max-len", type=int, default=2048,
                   help="lognormal: input + output of a request at most this (the server's max-model-len)")
    d.add_argument("--seed", type=int, default=0, help="seed of the lengths, prompts and arrival times")
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf: all at once")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 is Poisson, <1 burstier, >1 steadier")
    t.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    t.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    t.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the drawn output length")
    t.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    o = p.add_argument_group("output")
    o.add_argument("--result-file", default=None, help="write the results as JSON here")
    o.add_argument("--save-detailed", action="store_true", help="add per-request timings to the JSON")
    o.add_argument("--label", default=None, help="free text stored in the JSON (e.g. the server's config)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    start: float = 0.0


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_random_requests(a: argparse.Namespace, model: str) -> list[dict]:
    rng = random.Random(a.seed)
    if a.dataset_name == "lognormal":
        pairs = lognormal_lengths(a.num_prompts, a.random_input_len, a.random_output_len, a.lognormal_sigma,
                                  a.lognormal_max_len, a.seed)
        ins, outs = [i for i, _ in pairs], [o for _, o in pairs]
    else:
        ins = _lengths(rng, a.num_prompts, a.random_input_len, a.random_range_ratio)
        outs = _lengths(rng, a.num_prompts, a.random_output_len, a.random_range_ratio)
    bodies = []
    for n_in, n_out in zip(ins, outs):
        body = {"model": model, "max_tokens": n_out, "temperature": a.temperature, "ignore_eos": a.ignore_eos,
                "stream": True, "stream_options": {"include_usage": True}}
        if a.endpoint == "/v1/completions":
            body["prompt"] = [rng.randrange(a.random_vocab_size) for _ in range(n_in)]
        else:
            words, size = [], 0
            while size < n_in:
                w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                words.append(w)
                size += len(w) + 1
            body["messages"] = [{"role": "user", "content": " ".join(words)[:n_in]}]
        bodies.append(body)
    return bodies


async def _one_request(client, url: str, body: dict, headers: dict, timeout: float) -> RequestResult:
    res = RequestResult(start=time.perf_counter())
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
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - res.start
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


def _summary(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    v = sorted(x * scale for x in values)
    # Linear interpolation between closest ranks, as numpy's default percentile does.
    pos = 0.99 * (len(v) - 1)
    lo = int(pos)
    p99 = v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)
    return {"mean": statistics.fmean(v), "median": statistics.median(v),
            "std": statistics.pstdev(v) if len(v) > 1 else 0.0, "p99": p99}


_SERVER_HINT = ("start a server first (`tp-overlap serve`, in another terminal), or point --base-url or "
                "--host/--port at one")


def server_root(url: str) -> str:
    """The server's root URL: OpenAI clients take it with `/v1` (the README's client example does), and the
    routes here add that themselves."""
    url = url.rstrip("/")
    return url[:-len("/v1")] if url.endswith("/v1") else url


async def _first_model(client, base: str, headers: dict) -> str:
    """The first model the server lists, or CliError naming what went wrong."""
    import httpx

    try:
        r = await client.get(base + "/v1/models", headers=headers)
    except httpx.HTTPError as e:
        raise CliError(f"cannot reach the server at {base}: {type(e).__name__}: {e}", hint=_SERVER_HINT,
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


async def run_benchmark(a: argparse.Namespace) -> dict:
    import httpx

    from tqdm import tqdm

    base = server_root(a.base_url or f"http://{a.host}:{a.port}")
    api_key = a.api_key or options.env_api_key(openai_too=True)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = a.max_concurrency or a.num_prompts
    limits = httpx.Limits(max_connections=max(limit, 1), max_keepalive_connections=max(limit, 1))
    async with httpx.AsyncClient(limits=limits, timeout=a.request_timeout) as client:
        model = a.model or await _first_model(client, base, headers)
        bodies = make_random_requests(a, model)
        gaps = _arrival_gaps(random.Random(a.seed + 1), len(bodies), a.request_rate, a.burstiness)
        sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        bar = tqdm(total=len(bodies), desc="requests", unit="req", disable=a.disable_tqdm, file=sys.stderr)

        async def limited(body):
            try:
                if sem is None:
                    return await _one_request(client, base + a.endpoint, body, headers, a.request_timeout)
                async with sem:
                    return await _one_request(client, base + a.endpoint, body, headers, a.request_timeout)
            finally:
                bar.update(1)

        t0 = time.perf_counter()
        tasks = []
        for body, gap in zip(bodies, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(body)))
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    if all(r.error.startswith("ConnectError") for r in results):
        raise CliError(f"every request failed: cannot connect to {base} ({results[0].error})", hint=_SERVER_HINT,
                       status=1)

    good = [r for r in results if r.ok]
    n_in = sum(r.prompt_tokens for r in good)
    n_out = sum(r.output_tokens for r in good)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    out = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "label": a.label,
        "base_url": base,
        "endpoint": a.endpoint,
        "model": model,
        "dataset": a.dataset_name,
        "num_prompts": a.num_prompts,
        "random_input_len": a.random_input_len,
        "random_output_len": a.random_output_len,
        "random_range_ratio": a.random_range_ratio,
        **({"lognormal_sigma": a.lognormal_sigma, "lognormal_max_len": a.lognormal_max_len}
           if a.dataset_name == "lognormal" else {}),
        "request_rate": "inf" if math.isinf(a.request_rate) else a.request_rate,
        "burstiness": a.burstiness,
        "max_concurrency": a.max_concurrency,
        "ignore_eos": a.ignore_eos,
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(good) / duration if duration > 0 else 0.0,
        "output_throughput": n_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (n_in + n_out) / duration if duration > 0 else 0.0,
    }
    for name, vals in (("ttft", [r.ttft for r in good]), ("tpot", tpots),
                       ("itl", [x for r in good for x in r.itl]), ("e2el", [r.latency for r in good])):
        for stat, v in _summary(vals).items():
            out[f"{stat}_{name}_ms"] = v
    if a.save_detailed:
        out["requests"] = [asdict(r) for r in results]
    return out


def format_report(res: dict) -> str:
    rows = [
        ("Completed requests", res["completed"]),
        ("Failed requests", res["failed"]),
        ("Max concurrency", res["max_concurrency"] or "unlimited"),
        ("Request rate (req/s)", res["request_rate"]),
        ("Duration (s)", f"{res['duration_s']:.2f}"),
        ("Input tokens", res["total_input_tokens"]),
        ("Output tokens", res["total_output_tokens"]),
        ("Request throughput (req/s)", f"{res['request_throughput']:.2f}"),
        ("Output throughput (tok/s)", f"{res['output_throughput']:.2f}"),
        ("Total throughput (tok/s)", f"{res['total_token_throughput']:.2f}"),
    ]
    lines = [f"{'tp-overlap bench serve':=^56}"] + [f"{k:<40}{v:>16}" for k, v in rows]
    for name, title in (("ttft", "time to first token"), ("tpot", "time per output token, after the first"),
                        ("itl", "inter-token latency"), ("e2el", "end-to-end latency")):
        lines.append(f"{' ' + title + ' ':-^56}")
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {name.upper()} (ms)':<40}{res[f'{stat}_{name}_ms']:>16.2f}")
    if res["errors"]:
        lines.append("errors:")
        lines += [f"  {e}" for e in res["errors"]]
    lines.append("=" * 56)
    return "\n".join(lines)


def bench_serve_main(a: argparse.Namespace) -> int:
    """Exit status 1 when any request failed, so that scripts notice."""
    for name in ("num_prompts", "random_input_len", "random_output_len", "random_vocab_size"):
        if getattr(a, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= a.random_range_ratio < 1:
        raise CliError("--random-range-ratio must be in [0, 1)")
    if a.dataset_name == "lognormal" and (a.lognormal_sigma < 0 or a.lognormal_max_len < 8):
        raise CliError("--lognormal-sigma must be >= 0 and --lognormal-max-len >= 8")
    if a.request_rate <= 0 or a.burstiness <= 0 or (a.max_concurrency is not None and a.max_concurrency < 1):
        raise CliError("--request-rate, --burstiness and --max-concurrency must be positive")
    res = asyncio.run(run_benchmark(a))
    print(format_report(res))
    if a.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(a.result_file)), exist_ok=True)
        with open(a.result_file, "w") as f:
            json.dump(res, f, indent=2)
        print(f"results written to {a.result_file}")
    return 1 if res["failed"] else 0
