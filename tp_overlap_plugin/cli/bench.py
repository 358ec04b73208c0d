"""`tp-overlap bench`: `serve` (a load test of a running server, with `vllm bench serve`'s options) and the
offline `throughput` / `latency`, each turned into its typed config (BenchServeConfig,
OfflineBenchConfig) before it runs."""

from __future__ import annotations

import argparse

from tp_overlap_plugin.serving.benchmarks.offline import OfflineBenchConfig
from tp_overlap_plugin.serving.benchmarks.serve_config import (BACKENDS, CHAT, COMPLETIONS, DATASETS, GOODPUT_METRICS,
                                                               METRICS, BenchServeConfig)
from tp_overlap_plugin.serving.user_errors import CliError

from .engine_args import add_engine_args, engine_config_from_args
from .parser import add_debug_arg


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    d = BenchServeConfig()
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default=None,
                   help="server URL, e.g. http://10.0.0.5:8000 (or the OpenAI client's http://10.0.0.5:8000/v1; "
                        "default: --host/--port)")
    g.add_argument("--host", default=d.host, help="server host, when no --base-url")
    g.add_argument("--port", type=int, default=d.port, help="server port, when no --base-url")
    g.add_argument("--backend", default=d.backend, choices=BACKENDS,
                   help="vllm and openai post to /v1/completions, openai-chat to /v1/chat/completions")
    g.add_argument("--endpoint", default=None, choices=[COMPLETIONS, CHAT],
                   help="the route every request goes to (default: the --backend's)")
    g.add_argument("--model", default=None, help="model name to send (default: the first one /v1/models lists)")
    g.add_argument("--tokenizer", default=None,
                   help="a Hugging Face tokenizer (name or directory) that counts the sharegpt and hf datasets' "
                        "tokens (default: the server's own /tokenize)")
    # Read from the environment at run time, not as the option's default: --help would print the key.
    g.add_argument("--api-key", default=None, help="bearer token (default: $TP_OVERLAP_API_KEY, else $OPENAI_API_KEY)")
    g.add_argument("--ready-check-timeout-sec", type=float, default=d.ready_check_timeout_sec,
                   help="wait up to this many seconds for the server to answer before the run; 0: no waiting")
    s = p.add_argument_group("dataset")
    s.add_argument("--dataset-name", default=d.dataset_name, choices=DATASETS,
                   help="random: uniform lengths around --random-input-len/--random-output-len; lognormal: "
                        "long-tailed lengths with those medians, like a ShareGPT-style set, made in code; sharegpt: "
                        "a local ShareGPT JSON file (--dataset-path); hf: a Hugging Face Hub dataset (--dataset-path "
                        "its id; needs the `datasets` package and the Hub)")
    s.add_argument("--dataset-path", default=None, help="sharegpt: the JSON file; hf: the dataset's Hub id")
    s.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests to send")
    s.add_argument("--random-input-len", type=int, default=d.random_input_len,
                   help="prompt length: token ids for /v1/completions, characters for chat")
    s.add_argument("--random-output-len", type=int, default=d.random_output_len, help="max_tokens of a request")
    s.add_argument("--random-range-ratio", type=float, default=d.random_range_ratio,
                   help="lengths are drawn from [len*(1-r), len*(1+r)]; 0: fixed")
    s.add_argument("--random-prefix-len", type=int, default=d.random_prefix_len,
                   help="one shared prefix of this length (token ids; characters for chat) before every random prompt")
    s.add_argument("--random-vocab-size", type=int, default=d.random_vocab_size,
                   help="completion prompts use token ids in [0, N); 256 fits every supported tokenizer")
    s.add_argument("--lognormal-sigma", type=float, default=d.lognormal_sigma, help="lognormal: the lengths' shape")
    s.add_argument("--lognormal-max-len", type=int, default=d.lognormal_max_len,
                   help="lognormal: input + output of a request at most this (the server's max-model-len)")
    s.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: max_tokens of every request (default: the token count of the entry's answer)")
    s.add_argument("--hf-subset", default=None, help="hf: the dataset's subset (configuration)")
    s.add_argument("--hf-split", default=d.hf_split, help="hf: the split to read")
    s.add_argument("--hf-output-len", type=int, default=None,
                   help="hf: max_tokens of every request (default: the token count of the row's answer)")
    s.add_argument("--seed", type=int, default=d.seed, help="seed of the lengths, prompts and arrival times")
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=d.request_rate,
                   help="requests per second, Poisson arrivals; inf: all at once")
    t.add_argument("--burstiness", type=float, default=d.burstiness,
                   help="gamma shape of the inter-arrival times: 1 is Poisson, <1 burstier, >1 steadier")
    t.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    t.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature of every request")
    t.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=d.ignore_eos,
                   help="generate exactly the drawn output length, past end-of-sequence (as in vLLM, off unless given)")
    t.add_argument("--request-timeout", type=float, default=d.request_timeout, help="seconds per request")
    o = p.add_argument_group("output")
    o.add_argument("--percentile-metrics", default=",".join(d.percentile_metrics),
                   help=f"comma-separated metrics to report with percentiles, of: {', '.join(METRICS)}")
    o.add_argument("--metric-percentiles", default=",".join(f"{q:g}" for q in d.metric_percentiles),
                   help="comma-separated percentiles of those metrics, e.g. 50,90,99")
    o.add_argument("--goodput", nargs="+", default=None, metavar="KEY:VALUE",
                   help=f"service-level objectives in ms, e.g. ttft:500 tpot:50 (keys: {', '.join(GOODPUT_METRICS)}): "
                        "request_goodput counts the requests per second that meet them all")
    o.add_argument("--save-result", action="store_true",
                   help="write the JSON as <label>-<rate>qps[-concurrency<N>]-<model>-<date>.json "
                        "(or --result-filename) in --result-dir")
    o.add_argument("--result-dir", default=None, help="the directory of --save-result (default: the current one)")
    o.add_argument("--result-filename", default=None, help="the file name of --save-result")
    o.add_argument("--result-file", default=None, help="write the JSON to this path (--save-result's name aside)")
    o.add_argument("--save-detailed", action="store_true", help="add per-request timings and texts to the JSON")
    o.add_argument("--label", default=None, help="free text stored in the JSON and naming its file (default: --backend)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _list(flag: str, text: str, allowed=None, convert=str) -> tuple:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    try:
        values = tuple(convert(x) for x in items)
    except ValueError:
        raise CliError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    bad = [x for x in values if allowed is not None and x not in allowed]
    if bad or not values:
        raise CliError(f"{flag}: unknown {', '.join(map(str, bad)) or 'empty list'}; choose from {', '.join(allowed)}"
                       if allowed else f"{flag} is empty")
    return values


def _goodput(pairs: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for pair in pairs or ():
        key, _, value = pair.partition(":")
        try:
            bound = float(value)
        except ValueError:
            bound = -1.0
        if key not in GOODPUT_METRICS or bound < 0:
            raise CliError(f"--goodput {pair!r}: each objective is KEY:MILLISECONDS with KEY one of "
                           f"{', '.join(GOODPUT_METRICS)} and a value >= 0, e.g. ttft:500")
        out[key] = bound
    return out


def bench_serve_config_from_args(a: argparse.Namespace) -> BenchServeConfig:
    """The BenchServeConfig the options describe; CliError naming the option when they do not make one."""
    for name in ("num_prompts", "random_input_len", "random_output_len", "random_vocab_size"):
        if getattr(a, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("random_prefix_len", "ready_check_timeout_sec"):
        if getattr(a, name) < 0:
            raise CliError(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("sharegpt_output_len", "hf_output_len"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= a.random_range_ratio < 1:
        raise CliError("--random-range-ratio must be in [0, 1)")
    if a.dataset_name == "lognormal" and (a.lognormal_sigma < 0 or a.lognormal_max_len < 8):
        raise CliError("--lognormal-sigma must be >= 0 and --lognormal-max-len >= 8")
    if a.request_rate <= 0 or a.burstiness <= 0 or (a.max_concurrency is not None and a.max_concurrency < 1):
        raise CliError("--request-rate, --burstiness and --max-concurrency must be positive")
    if a.dataset_path is not None and a.dataset_name in ("random", "lognormal"):
        raise CliError(f"--dataset-name {a.dataset_name} makes its prompts; --dataset-path is for sharegpt and hf",
                       hint="add --dataset-name sharegpt (a local file) or hf (a Hub dataset)")
    if a.backend == "openai-chat" and a.endpoint not in (None, CHAT):
        raise CliError(f"--backend openai-chat posts chat completions, not to --endpoint {a.endpoint}",
                       hint=f"leave --endpoint out, or give {CHAT}")
    if a.result_file and (a.result_dir or a.result_filename):
        raise CliError("--result-file names the file itself: give it, or --result-dir / --result-filename")
    return BenchServeConfig(
        base_url=a.base_url, host=a.host, port=a.port, backend=a.backend, endpoint=a.endpoint, model=a.model,
        tokenizer=a.tokenizer, api_key=a.api_key, ready_check_timeout_sec=a.ready_check_timeout_sec,
        dataset_name=a.dataset_name, dataset_path=a.dataset_path, num_prompts=a.num_prompts,
        random_input_len=a.random_input_len, random_output_len=a.random_output_len,
        random_range_ratio=a.random_range_ratio, random_prefix_len=a.random_prefix_len,
        random_vocab_size=a.random_vocab_size, lognormal_sigma=a.lognormal_sigma,
        lognormal_max_len=a.lognormal_max_len, sharegpt_output_len=a.sharegpt_output_len, hf_subset=a.hf_subset,
        hf_split=a.hf_split, hf_output_len=a.hf_output_len, seed=a.seed, request_rate=a.request_rate,
        burstiness=a.burstiness, max_concurrency=a.max_concurrency, temperature=a.temperature,
        ignore_eos=a.ignore_eos, request_timeout=a.request_timeout,
        percentile_metrics=_list("--percentile-metrics", a.percentile_metrics, METRICS),
        metric_percentiles=_percentiles(a.metric_percentiles), goodput=_goodput(a.goodput),
        save_result=a.save_result, save_detailed=a.save_detailed, result_dir=a.result_dir,
        result_filename=a.result_filename, result_file=a.result_file, label=a.label, disable_tqdm=a.disable_tqdm)


def _percentiles(text: str) -> tuple[float, ...]:
    values = _list("--metric-percentiles", text, convert=float)
    if not all(0 < p < 100 for p in values):
        raise CliError(f"--metric-percentiles must lie in (0, 100), got {text!r}")
    return values


def run_bench_serve(a: argparse.Namespace) -> int:
    from tp_overlap_plugin.serving.benchmarks.serve import bench_serve_main

    return bench_serve_main(bench_serve_config_from_args(a))


# ---- offline: bench throughput / bench latency ----------------------------------------------------

def _add_offline_subcommands(bench_sub) -> None:
    d = OfflineBenchConfig()
    t = bench_sub.add_parser("throughput", help="offline throughput: num-prompts random requests at once")
    add_engine_args(t)
    g = t.add_argument_group("benchmark")
    g.add_argument("--input-len", type=int, default=d.input_len,
                   help="prompt tokens per request (lognormal: the median)")
    g.add_argument("--output-len", type=int, default=d.output_len,
                   help="output tokens per request (lognormal: the median)")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests per round")
    g.add_argument("--dataset", default=d.dataset, choices=["fixed", "lognormal"],
                   help="lognormal: long-tailed lengths (ShareGPT-like) with --input-len/--output-len as medians, "
                        "clipped to max-model-len")
    g.add_argument("--lognormal-sigma", type=float, default=d.lognormal_sigma, help="shape of the lognormal lengths")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    g.add_argument("--min-seconds", type=float, default=d.min_seconds,
                   help="repeat the num-prompts round (fresh prompts) until this much time is measured")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also write the results as JSON here")
    add_debug_arg(t)
    t.set_defaults(func=run_bench_offline, mode="throughput")
    lat = bench_sub.add_parser("latency", help="one batch, end to end, repeated: TTFT and decode step time")
    add_engine_args(lat)
    g = lat.add_argument_group("benchmark")
    g.add_argument("--input-len", type=int, default=d.input_len, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=d.output_len, help="output tokens per request")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="requests in the batch")
    g.add_argument("--iters", type=int, default=d.iters, help="times the batch runs (the first warms up)")
    g.add_argument("--output-json", default=None, metavar="PATH", help="also write the results as JSON here")
    add_debug_arg(lat)
    lat.set_defaults(func=run_bench_offline, mode="latency")


def offline_config_from_args(a: argparse.Namespace) -> OfflineBenchConfig:
    names = ["input_len", "output_len"] + (["num_prompts"] if a.mode == "throughput" else ["batch_size", "iters"])
    for name in names:
        if getattr(a, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if getattr(a, "max_concurrency", None) is not None and a.max_concurrency < 1:
        raise CliError(f"--max-concurrency must be >= 1, got {a.max_concurrency}")
    fields = ("input_len", "output_len", "num_prompts", "dataset", "lognormal_sigma", "max_concurrency", "min_seconds",
              "batch_size", "iters", "output_json")
    return OfflineBenchConfig(mode=a.mode, **{f: getattr(a, f) for f in fields if hasattr(a, f)})


def run_bench_offline(a: argparse.Namespace) -> int:
    from tp_overlap_plugin.serving.benchmarks.offline import bench_offline_main

    bench = offline_config_from_args(a)
    return bench_offline_main(engine_config_from_args(a), bench)


def add_bench_subcommand(sub) -> argparse.ArgumentParser:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bs = bsub.add_parser("serve", help="load test a running OpenAI-compatible server (like `vllm bench serve`)")
    add_bench_serve_args(bs)
    add_debug_arg(bs)
    bs.set_defaults(func=run_bench_serve)
    _add_offline_subcommands(bsub)
    return b
