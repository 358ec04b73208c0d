"""Prometheus metrics of the OpenAI-compatible server.

Two kinds: counters and histograms that the request handlers update as tokens stream out, and gauges
that are read at scrape time from the stats the engine core sends with every step (running / waiting
requests, KV-cache blocks, TP op paths), so a scrape shows the engine's state after its latest step
rather than the last value someone remembered to set.

Each server owns its own registry, so several servers (or tests) in one process do not collide.

Beside ours, the series vLLM's Grafana dashboard and alerts read, under vLLM's names (`vllm:` prefix) and
labels (`model_name`, `engine`; one engine here, "0"): requests running and waiting, KV-cache usage,
preemptions, prompt and generation tokens (counters, and per request the request_prompt_tokens and
request_generation_tokens histograms with vLLM's 1-2-5 buckets up to max_model_len), finished requests, and
the TTFT, inter-token (also under its older name, time_per_output_token), per-request TPOT and end-to-end
latency histograms. Counters are declared without `_total`, which prometheus_client appends,
so the exposed names are exactly vLLM's (`vllm:generation_tokens_total`).
"""

from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily

PREFIX = "tp_overlap"
VLLM = "vllm:"
VLLM_LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"

# Latency buckets in seconds: sub-millisecond decode steps on a GPU up to minutes-long CPU requests.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector:
    def __init__(self, stats: Callable[[], Optional[dict]], model_name: str):
        self._stats = stats
        self._model = model_name

    def collect(self):
        s = self._stats()
        if s is None:
            return
        gauges = [
            ("num_requests_running", "Requests in the engine's running batch"),
            ("num_requests_waiting", "Requests queued for admission (including preempted ones)"),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)"),
            ("kv_cache_free_blocks", "KV-cache blocks free (cached prefixes that may be evicted count as free)"),
            ("kv_cache_total_blocks", "KV-cache blocks in the pool"),
        ]
        for key, doc in gauges:
            g = GaugeMetricFamily(f"{PREFIX}_{key}", doc, labels=["model_name"])
            g.add_metric([self._model], float(s[key]))
            yield g
            if key in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                g = GaugeMetricFamily(f"{VLLM}{key}", doc, labels=VLLM_LABELS)
                g.add_metric([self._model, ENGINE_INDEX], float(s[key]))
                yield g
        for key, doc in (("num_preemptions", "Sequences preempted (recomputed later) because the KV cache ran out"),
                         ("prefix_cache_hit_blocks", "KV blocks reused from the prefix cache")):
            c = CounterMetricFamily(f"{PREFIX}_{key}", doc, labels=["model_name"])
            c.add_metric([self._model], float(s[key]))
            yield c
        c = CounterMetricFamily(f"{VLLM}num_preemptions", "Sequences preempted (recomputed later) because the KV cache ran out", labels=VLLM_LABELS)
        c.add_metric([self._model, ENGINE_INDEX], float(s["num_preemptions"]))
        yield c
        # Which path each TP op took on this rank (rank 0 serves HTTP): with --tp-overlap this is how an
        # operator sees that the overlapped kernels run rather than a silent fallback.
        c = CounterMetricFamily(f"{PREFIX}_tp_op_calls", "TP ops by path (kernel, fallback, sequential, ...)",
                                labels=["model_name", "path"])
        for path, n in sorted(s.get("tp_op_calls", {}).items()):
            c.add_metric([self._model, path], float(n))
        yield c


def token_count_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets of the token-count histograms: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            b = m * 10 ** exponent
            if b > max_model_len:
                return out
            out.append(b)
        exponent += 1


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], Optional[dict]], max_model_len: int = 4096):
        # The *_created timestamp series double the output and no dashboard reads them.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.model_name = model_name
        self.requests = Counter(f"{PREFIX}_requests", "Finished generation requests by endpoint and outcome",
                                m + ["endpoint", "finish_reason"], registry=r)
        self.http_responses = Counter(f"{PREFIX}_http_responses", "HTTP responses by route and status code",
                                      ["route", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests", m, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens", m, registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time from arrival to the first token",
                              m, buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time between output tokens of one sequence after the first",
                              m, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Time from arrival to the last token",
                             m, buckets=_E2E_BUCKETS, registry=r)
        self.in_flight = Gauge(f"{PREFIX}_num_requests_in_flight",
                               "HTTP generation requests being served (includes tokenization and streaming)",
                               m, registry=r)
        r.register(_EngineCollector(stats, model_name))
        self.vllm = _VllmSeries(r, model_name, max_model_len)

    def observe_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)
        self.vllm.prompt_tokens.inc(num_tokens)

    def observe_tokens(self, gap_s: float, num_tokens: int) -> None:
        """`num_tokens` output tokens of one sequence that arrived `gap_s` after its previous ones."""
        # vLLM observes both per token; its per-request mean is request_time_per_output_token_seconds.
        for _ in range(num_tokens):
            self.vllm.itl.observe(gap_s / num_tokens)
            self.vllm.tpot.observe(gap_s / num_tokens)

    def observe_sequence(self, endpoint: str, finish_reason: Optional[str], arrival: float,
                         first_token: Optional[float], last_token: Optional[float], num_generated: int,
                         num_prompt: int = 0) -> None:
        """One finished (or aborted) choice of a request (one engine request, as vLLM counts them)."""
        name, v = self.model_name, self.vllm
        v.request_prompt_tokens.observe(num_prompt)
        v.request_generation_tokens.observe(num_generated)
        self.requests.labels(name, endpoint, finish_reason or "error").inc()
        v.request_success(finish_reason or "error").inc()
        self.generation_tokens.labels(name).inc(num_generated)
        v.generation_tokens.inc(num_generated)
        if first_token is not None:
            self.ttft.labels(name).observe(first_token - arrival)
            v.ttft.observe(first_token - arrival)
            if last_token is not None:
                self.e2e.labels(name).observe(last_token - arrival)
                v.e2e.observe(last_token - arrival)
                if num_generated > 1:
                    self.tpot.labels(name).observe((last_token - first_token) / (num_generated - 1))
                    v.request_tpot.observe((last_token - first_token) / (num_generated - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VllmSeries:
    """The request-level series under vLLM's names, each bound to this server's labels."""

    def __init__(self, r: CollectorRegistry, model_name: str, max_model_len: int):
        lv = (model_name, ENGINE_INDEX)

        def hist(name, doc, buckets):
            return Histogram(VLLM + name, doc, VLLM_LABELS, buckets=buckets, registry=r).labels(*lv)

        self.prompt_tokens = Counter(f"{VLLM}prompt_tokens", "Prompt tokens of admitted requests", VLLM_LABELS,
                                     registry=r).labels(*lv)
        self.generation_tokens = Counter(f"{VLLM}generation_tokens", "Generated tokens",
                                         VLLM_LABELS, registry=r).labels(*lv)
        success = Counter(f"{VLLM}request_success", "Finished sequences by finish reason",
                          VLLM_LABELS + ["finished_reason"], registry=r)
        self.request_success = lambda reason: success.labels(*lv, reason)
        tokens = token_count_buckets(max_model_len)
        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens of each finished request", tokens)
        self.request_generation_tokens = hist("request_generation_tokens", "Generated tokens of each finished "
                                              "request", tokens)
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first token", _TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Time between consecutive output tokens of a sequence "
                         "(vLLM's older name of inter_token_latency_seconds)", _TPOT_BUCKETS)
        self.request_tpot = hist("request_time_per_output_token_seconds",
                                 "Mean time between output tokens of one sequence after the first", _TPOT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens of a sequence", _TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token",
                        _E2E_BUCKETS)
