"""The result of a `bench serve` run, under `vllm bench serve`'s JSON keys so that a script reads
either: `duration`, `completed`, `failed`, `total_input_tokens`, `total_output_tokens`,
`request_throughput`, `request_goodput`, `output_throughput`, `total_token_throughput`,
`max_output_tokens_per_s`, `max_concurrent_requests`, and per metric of --percentile-metrics
`mean_/median_/std_<metric>_ms` and `p<P>_<metric>_ms` per --metric-percentiles. With --save-detailed the
per-request lists too (`input_lens`, `output_lens`, `ttfts`, `itls`, `start_times`, `generated_texts`,
`errors`, seconds as vLLM stores them).

TTFT is the time to the first chunk of generated text, ITL the gaps between later chunks (a token that
decodes to no text yet, such as part of a UTF-8 character, arrives with the next one), TPOT a request's
(latency - TTFT) / (output tokens - 1), E2EL its whole latency. Token counts come from the server's usage
report, not from client-side tokenization; the peak output rate counts chunks per second of the run.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

from .serve_config import BenchServeConfig

TITLES = {"ttft": "time to first token", "tpot": "time per output token, after the first",
          "itl": "inter-token latency", "e2el": "end-to-end latency"}


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    start: float = 0.0       # seconds after the run's start
    text: str = ""

    @property
    def tpot(self) -> Optional[float]:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks, as numpy's default percentile."""
    v = sorted(values)
    pos = p / 100 * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def percentile_key(p: float) -> str:
    """p99, p99.9: as vLLM names the keys."""
    return f"p{int(p) if float(p).is_integer() else p}"


def summarize(values: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean / median / std / each percentile of `values` (seconds) in milliseconds; 0 when there are none."""
    v = [x * 1000.0 for x in values] or [0.0]
    out = {"mean": statistics.fmean(v), "median": statistics.median(v), "std": statistics.pstdev(v)}
    out.update({percentile_key(p): percentile(v, p) for p in percentiles})
    return out


def _good(r: RequestResult, goodput: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(measured[name] * 1000.0 <= bound for name, bound in goodput.items())


def _peaks(results: list[RequestResult], duration: float) -> tuple[float, int]:
    """vLLM's peak figures, by whole seconds of the run: the most output chunks in one second, and the
    requests active in that second (each request that ran at any time in it counts)."""
    seconds = max(1, math.ceil(duration))
    chunks, active = [0] * seconds, [0] * seconds
    for r in results:
        if not r.ok:
            continue
        t = r.start + r.ttft
        for gap in [0.0, *r.itl]:
            t += gap
            chunks[min(int(t), seconds - 1)] += 1
        for s in range(int(r.start), min(int(r.start + r.latency), seconds - 1) + 1):
            active[s] += 1
    peak = max(range(seconds), key=chunks.__getitem__)
    return float(chunks[peak]), active[peak]


def build_result(cfg: BenchServeConfig, results: list[RequestResult], duration: float, base_url: str, model: str,
                 tokenizer_id: Optional[str]) -> dict:
    good = [r for r in results if r.ok]
    n_in = sum(r.prompt_tokens for r in good)
    n_out = sum(r.output_tokens for r in good)
    rate = (lambda x: x / duration if duration > 0 else 0.0)
    peak_tokens, peak_requests = _peaks(results, duration)
    out = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": cfg.backend,
        "backend": cfg.backend,
        "label": cfg.label,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": cfg.num_prompts,
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        # ours besides vLLM's: where it ran and what it sent
        "base_url": base_url,
        "endpoint": cfg.route,
        "dataset_name": cfg.dataset_name,
        "random_input_len": cfg.random_input_len,
        "random_output_len": cfg.random_output_len,
        "random_range_ratio": cfg.random_range_ratio,
        "random_prefix_len": cfg.random_prefix_len,
        **({"lognormal_sigma": cfg.lognormal_sigma, "lognormal_max_len": cfg.lognormal_max_len}
           if cfg.dataset_name == "lognormal" else {}),
        **({"dataset_path": cfg.dataset_path} if cfg.dataset_path else {}),
        "ignore_eos": cfg.ignore_eos,
        "duration": duration,
        "completed": len(good),
        "failed": len(results) - len(good),
        "error_samples": sorted({r.error for r in results if not r.ok})[:10],
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": rate(len(good)),
        "request_goodput": rate(sum(_good(r, cfg.goodput) for r in good)) if cfg.goodput else None,
        "output_throughput": rate(n_out),
        "total_token_throughput": rate(n_in + n_out),
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    values = {"ttft": [r.ttft for r in good], "tpot": [r.tpot for r in good if r.tpot is not None],
              "itl": [x for r in good for x in r.itl], "e2el": [r.latency for r in good]}
    for name in cfg.percentile_metrics:
        for stat, v in summarize(values[name], cfg.metric_percentiles).items():
            out[f"{stat}_{name}_ms"] = v
    if cfg.save_detailed:
        out.update(input_lens=[r.prompt_tokens for r in results], output_lens=[r.output_tokens for r in results],
                   ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                   start_times=[r.start for r in results], generated_texts=[r.text for r in results],
                   errors=[r.error for r in results])
    return out


def result_path(cfg: BenchServeConfig, res: dict) -> Optional[str]:
    """Where the JSON goes: --result-file, else with --save-result vLLM's name
    (<label or backend>-<rate>qps[-concurrency<N>]-<model>-<date>.json, or --result-filename) in --result-dir."""
    if cfg.result_file:
        return cfg.result_file
    if not cfg.save_result:
        return None
    concurrency = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency is not None else ""
    name = cfg.result_filename or (f"{cfg.label or cfg.backend}-{cfg.request_rate}qps{concurrency}-"
                                   f"{res['model_id'].split('/')[-1]}-{res['date']}.json")
    return os.path.join(cfg.result_dir, name) if cfg.result_dir else name


def format_report(res: dict, cfg: BenchServeConfig) -> str:
    rows = [
        ("Completed requests", res["completed"]),
        ("Failed requests", res["failed"]),
        ("Max concurrency", res["max_concurrency"] or "unlimited"),
        ("Request rate (req/s)", res["request_rate"]),
        ("Duration (s)", f"{res['duration']:.2f}"),
        ("Input tokens", res["total_input_tokens"]),
        ("Output tokens", res["total_output_tokens"]),
        ("Request throughput (req/s)", f"{res['request_throughput']:.2f}"),
        *([("Request goodput (req/s)", f"{res['request_goodput']:.2f}")] if cfg.goodput else []),
        ("Output throughput (tok/s)", f"{res['output_throughput']:.2f}"),
        ("Peak output throughput (tok/s)", f"{res['max_output_tokens_per_s']:.2f}"),
        ("Peak concurrent requests", res["max_concurrent_requests"]),
        ("Total throughput (tok/s)", f"{res['total_token_throughput']:.2f}"),
    ]
    lines = [f"{'tp-overlap bench serve':=^56}"] + [f"{k:<40}{v:>16}" for k, v in rows]
    for name in cfg.percentile_metrics:
        lines.append(f"{' ' + TITLES[name] + ' ':-^56}")
        for stat in ("mean", "median", *map(percentile_key, cfg.metric_percentiles)):
            lines.append(f"{f'{stat.capitalize()} {name.upper()} (ms)':<40}{res[f'{stat}_{name}_ms']:>16.2f}")
    if res["error_samples"]:
        lines.append("errors:")
        lines += [f"  {e}" for e in res["error_samples"]]
    lines.append("=" * 56)
    return "\n".join(lines)
