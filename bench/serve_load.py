"""The server under load, stock vs `--tp-overlap`: a Poisson request-rate sweep over HTTP, with the
two servers run alternately (A B A B ...) so that a few percent can be told apart.

    python bench/serve_load.py --model llama-3-8b --tp 2                   # 3 pairs, rates 4,16,inf
    python bench/serve_load.py --model llama-3-8b --tp 2 --pairs 2 --level-seconds 8 --rates 8,inf
    python bench/serve_load.py --model demo --tp 2 --quick                 # a logic check on the CPU

Each run starts `tp-overlap serve` in a fresh process, waits for /health, warms up with a burst of the
same workload (other prompts), then runs `tp-overlap bench serve` once per request rate: Poisson
arrivals for --level-seconds (at least --min-requests requests), and at rate `inf` --inf-requests
requests at once. The workload is seeded and the same for both servers: by default lognormal lengths
(a ShareGPT-like long tail made in code, serving/benchmarks/workloads.py). Then SIGTERM (the graceful path users
hit) and the next run. Both servers get the same KV pool.

Per level: output tokens/s, TTFT, TPOT and ITL at p50 and p99 (as `vllm bench serve` reports them),
per run; per pair the flag/stock ratio of output tokens/s and stock/flag of median TPOT (above 1: the
flag is faster), their median and min-max, a win or a loss only when every pair agrees. Below
saturation a server delivers what is offered, so the tokens/s ratio only separates the two at `inf`;
the latency ratios do at every rate. The JSON is rewritten after every run. JSON + markdown + PNG
(ratios with their spread, and the latency-throughput curve) in bench/results/
(serve-interleaved-<model>-tp<N>-<device>-<date>).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (add_comparison_args, bench_parser, by_pair, comparison_header, exit_on_sigterm,  # noqa: E402
                      fmt_ratio, interleaved, load_payload, log, md_table, median_or_nan, pair_ratios, ratio_chart,
                      report, start_comparison, write_results)

SCHEMA = "serve-interleaved/1"
STATS = [("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
         ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"), ("median_itl_ms", "ITL p50"),
         ("p99_itl_ms", "ITL p99")]


def bench_args(args, port: int, rate: float, num_prompts: int, seed: int, label: str):
    """The `tp-overlap bench serve` run of one level: exactly the drawn output lengths (ignore_eos)."""
    from tp_overlap_plugin.serving.benchmarks.serve_config import BenchServeConfig
    return BenchServeConfig(port=port, num_prompts=num_prompts, request_rate=rate,
                            dataset_name="random" if args.dataset == "fixed" else "lognormal",
                            random_input_len=args.input_len, random_output_len=args.output_len,
                            lognormal_sigma=args.lognormal_sigma, lognormal_max_len=args.max_len, label=label,
                            seed=seed, max_concurrency=args.max_concurrency or None, ignore_eos=True)


def level_requests(args, rate: float) -> int:
    if math.isinf(rate):
        return args.inf_requests
    return max(args.min_requests, math.ceil(rate * args.level_seconds))


def server_args(args, engine: str) -> list[str]:
    cmd = ["--model", args.model, "--tp", str(args.tp), "--max-model-len", str(args.max_len + 16),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--num-kv-blocks", str(kv_blocks(args)), "--no-access-log", "--log-level", "warning"]
    if args.model != "demo":
        cmd += ["--load-format", "dummy"]
    if engine == "overlap":
        cmd += ["--tp-overlap-config", json.dumps({"dispatch": args.dispatch})]
    return cmd + list(args.server_arg)


def kv_blocks(args, block_size: int = 16) -> int:
    """Every sequence the server may run at once at the longest length: no preemption, and the same pool
    for both servers whatever memory the heap takes."""
    return args.max_num_seqs * (-(-(args.max_len + 16) // block_size) + 1) + 8


def one_run(args, engine: str, pair: int) -> dict:
    from tp_overlap_plugin.serving.entrypoints.server_process import ServerProcess
    from tp_overlap_plugin.serving.benchmarks.serve import run_benchmark

    tag = f"serve {engine}#{pair + 1}"
    env = dict(os.environ)
    if args.device_cpu:
        env.setdefault("TRITON_INTERPRET", "1")  # the flag's kernels on the CPU
    run = {"pair": pair, "engine": engine, "levels": {}}
    t0 = time.monotonic()
    with ServerProcess(server_args(args, engine), start_timeout=args.startup_timeout, stop_timeout=30,
                       env=env) as srv:
        run["load_s"] = time.monotonic() - t0
        log(tag, f"server healthy after {run['load_s']:.1f} s")
        t1 = time.monotonic()
        # other prompts (seed) than the measured ones, so the prefix cache gives the levels nothing
        warm = asyncio.run(run_benchmark(bench_args(args, srv.port, float("inf"), args.warmup_requests, 10_000,
                                                    f"{engine} warm-up")))
        run["warmup_s"] = time.monotonic() - t1
        log(tag, f"warm-up: {warm['completed']} requests in {run['warmup_s']:.1f} s")
        for k, rate in enumerate(args.rate_list):
            res = asyncio.run(run_benchmark(bench_args(args, srv.port, rate, level_requests(args, rate), k,
                                                       f"{engine} rate={rate}")))
            run["levels"][_key(rate)] = res
            log(tag, f"rate {_key(rate)}: {res['completed']} requests in {res['duration']:.1f} s, "
                     f"{res['output_throughput']:.1f} out tok/s, TTFT p50 {res['median_ttft_ms']:.1f} ms, "
                     f"TPOT p50 {res['median_tpot_ms']:.2f} ms, failed {res['failed']}")
            if res["failed"]:
                run.setdefault("errors", []).append(f"rate {_key(rate)}: {res['failed']} failed: {res['error_samples'][:3]}")
    run["process_s"] = time.monotonic() - t0
    return run


def _key(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _level_value(level: dict, key: str):
    # results written before `bench serve` took vLLM's key names say duration_s (--replot reads them)
    return level["duration_s"] if key == "duration" and key not in level else level[key]


def summarize(runs: list[dict], levels: list[str], engines: tuple[str, ...]) -> dict:
    summary = {}
    for lv in levels:
        per, (st, ov) = by_pair(runs, engines, "levels", lv)
        s = {e: {k: [_level_value(g, k) for g in got] for k in [k for k, _ in STATS] + ["duration", "completed", "failed"]}
             for e, got in per.items()}
        if len(engines) == 2:
            s["throughput_ratio"] = pair_ratios([x["output_throughput"] for x in st],
                                                [x["output_throughput"] for x in ov])
            # latency: stock/flag, so that above 1 reads "the flag is faster" like the throughput ratio
            s["tpot_speedup"] = pair_ratios([x["median_tpot_ms"] for x in ov], [x["median_tpot_ms"] for x in st])
            s["ttft_speedup"] = pair_ratios([x["median_ttft_ms"] for x in ov], [x["median_ttft_ms"] for x in st])
        summary[lv] = s
    return summary


def markdown(payload: dict) -> str:
    summary, engines = payload["summary"], tuple(payload["config"]["engines"])
    lines = comparison_header("bench/serve_load.py", payload)
    rows = []
    for lv, s in summary.items():
        row = [lv, max(s[engines[0]]["completed"], default=0), median_or_nan(s[engines[0]]["duration"])]
        for e in engines:
            row.append(median_or_nan(s[e]["output_throughput"]))
        if len(engines) == 2:
            for key in ("throughput_ratio", "tpot_speedup", "ttft_speedup"):
                row += [fmt_ratio(s[key]), s[key].get("call", "-")]
        row.append(sum(sum(s[e]["failed"]) for e in engines))
        rows.append(row)
    headers = ["rate req/s", "requests", "duration s"] + [f"{e} out tok/s" for e in engines]
    if len(engines) == 2:
        headers += ["tok/s overlap/stock", "call", "TPOT p50 stock/overlap", "call", "TTFT p50 stock/overlap", "call"]
    lines.append(md_table(headers + ["failed"], rows))
    lat = []
    for lv, s in summary.items():
        for e in engines:
            lat.append([lv, e] + [median_or_nan(s[e][k]) for k, _ in STATS[1:]])
    lines.append("\nLatency (ms), median over runs:\n\n"
                 + md_table(["rate", "engine"] + [t for _, t in STATS[1:]], lat))
    runs = [[r["pair"] + 1, r["engine"], r.get("load_s", float("nan")), r.get("warmup_s", float("nan")),
             r.get("process_s", float("nan")), "; ".join(r.get("errors", []))] for r in payload["runs"]]
    lines.append("\nRuns in order (load: start to healthy; process: start to exit):\n\n" +
                 md_table(["pair", "engine", "load s", "warm-up s", "process s", "errors"], runs))
    return "\n".join(lines)


def chart(path: str, payload: dict) -> None:
    engines, summary = payload["config"]["engines"], payload["summary"]
    labels, ratios = [], []
    if len(engines) == 2:
        for lv, s in summary.items():
            labels += [f"tok/s @{lv}", f"TPOT @{lv}"]
            ratios += [s["throughput_ratio"], s["tpot_speedup"]]
    curves, styles = {}, {}
    for color, e in enumerate(engines):
        for k, name, line in (("median_tpot_ms", "TPOT p50", "-"), ("p99_tpot_ms", "TPOT p99", "--")):
            pts = [(median_or_nan(s[e]["output_throughput"]), median_or_nan(s[e][k]))
                   for s in summary.values() if s[e][k]]
            if pts:
                curves[f"{e} {name}"] = sorted(pts)
                styles[f"{e} {name}"] = f"C{color}o{line}"
    ratio_chart(path, labels, ratios, "overlap vs stock (>1: overlap better)", curves=curves,
                curve_labels=("output tokens/s (one point per request rate)", "ms per output token"),
                curve_styles=styles)


def write_outputs(payload: dict, out_dir: str) -> tuple[str, str]:
    paths = write_results(out_dir, payload["name"], payload, markdown(payload))
    chart(paths[0].replace(".json", ".png"), payload)
    return paths


def add_workload_args(p) -> None:
    """The workload and server options (serve_timeline.py takes them too)."""
    p.add_argument("--level-seconds", type=float, default=15.0, help="arrivals span this long at each finite rate")
    p.add_argument("--min-requests", type=int, default=32)
    p.add_argument("--inf-requests", type=int, default=256, help="requests at rate inf")
    p.add_argument("--warmup-requests", type=int, default=None, help="default: --max-num-seqs")
    p.add_argument("--dataset", default="lognormal", choices=["lognormal", "fixed"])
    p.add_argument("--input-len", type=int, default=256, help="fixed: the length; lognormal: the median")
    p.add_argument("--output-len", type=int, default=128, help="fixed: the length; lognormal: the median")
    p.add_argument("--lognormal-sigma", type=float, default=1.0)
    p.add_argument("--max-len", type=int, default=2048, help="input + output of a request at most")
    p.add_argument("--max-num-seqs", type=int, default=128, help="the server's")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the server's step token budget")
    p.add_argument("--max-concurrency", type=int, default=None, help="client-side cap on requests in flight")
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for both servers")
    p.add_argument("--startup-timeout", type=float, default=400)


def apply_quick(args) -> None:
    """--quick: a tiny workload (a logic check); then the defaults that follow from the options."""
    if args.quick:
        args.rates, args.level_seconds, args.min_requests, args.inf_requests = "4,inf", 1.0, 4, 6
        args.input_len, args.output_len, args.max_len, args.max_num_seqs = 12, 6, 48, 4
        args.max_num_batched_tokens = 64
    args.warmup_requests = args.warmup_requests or args.max_num_seqs


def main(argv=None):
    p = bench_parser(__doc__)
    add_comparison_args(p)
    p.add_argument("--rates", default="4,16,inf", help="request rates per second, Poisson arrivals; inf: all at once")
    add_workload_args(p)
    args = p.parse_args(argv)
    if args.replot:
        print("wrote", *write_outputs(*load_payload(args.replot)))
        return 0
    exit_on_sigterm()
    apply_quick(args)
    args.rate_list = [float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in args.rate_list):
        raise SystemExit("every rate must be positive")
    payload, engines, _ = start_comparison("serve", SCHEMA, args)
    args.device_cpu = payload["environment"]["device"] == "cpu"
    workload = (f"lognormal lengths, median {args.input_len} in / {args.output_len} out, sigma {args.lognormal_sigma}, "
                f"<= {args.max_len}" if args.dataset == "lognormal"
                else f"fixed {args.input_len} in / {args.output_len} out")
    config = payload["config"]
    config.update(rates=[_key(r) for r in args.rate_list], level_seconds=args.level_seconds,
                  min_requests=args.min_requests, inf_requests=args.inf_requests,
                  warmup_requests=args.warmup_requests, workload=workload, dataset=args.dataset,
                  input_len=args.input_len, output_len=args.output_len, lognormal_sigma=args.lognormal_sigma,
                  max_len=args.max_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_concurrency=args.max_concurrency,
                  server_args={e: server_args(args, e) for e in engines})
    payload["method"] = (
        f"Workload: {workload}; after a warm-up of {args.warmup_requests} requests, per level Poisson arrivals for "
        f"{args.level_seconds:g} s (at least {args.min_requests} requests), {args.inf_requests} requests at rate inf; "
        f"server --max-num-seqs {args.max_num_seqs}. Values: median over runs; ratios: median over pairs [min–max].")
    plan = interleaved(engines, args.pairs)
    log("serve", f"{len(plan)} runs: {' '.join(f'{e}#{i + 1}' for i, e in plan)}; rates {args.rates}; "
                 f"requests per level {[level_requests(args, r) for r in args.rate_list]}")
    failed = None
    for k, (pair, engine) in enumerate(plan):
        log("serve", f"run {k + 1}/{len(plan)}: {engine}, pair {pair + 1}")
        try:
            run = one_run(args, engine, pair)
        except Exception as e:  # the runs so far are still worth writing down
            failed = f"{engine}, pair {pair + 1}: {type(e).__name__}: {e}"
            run = {"pair": pair, "engine": engine, "levels": {}, "errors": [failed[:2000]]}
        payload["runs"].append(run)
        payload["summary"] = summarize(payload["runs"], config["rates"], engines)
        paths = write_outputs(payload, args.out)
        if failed:
            break
    report(payload, markdown(payload), paths)
    if failed:
        print(failed, file=sys.stderr)
    return 1 if failed or any(r.get("errors") for r in payload["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
