"""End-to-end tokens/s, stock vs `--tp-overlap`, measured so that a 3% difference can be told apart.

    python bench/e2e.py --model llama-3-8b --tp 2                      # 3 pairs, >= 15 s per scenario
    python bench/e2e.py --model llama-3-8b --tp 2 --min-seconds 6 --decode-requests 128 --mix-requests 128
    python bench/e2e.py --model llama-3-8b --tp 1                      # one GPU: the flag is the decode matmul alone
    python bench/e2e.py --model demo --device cpu --quick --min-seconds 0.2   # a logic check on the CPU
    python bench/e2e.py --model llama-3-8b --tp 1 --only decode --no-async-scheduling   # synchronous steps
    python bench/e2e.py --model llama-3-70b --tp 4 --scenarios prefill-b32 # the model a TP=4 user runs (dummy weights)

Stock and the flag run alternately, A B A B ..., for --pairs pairs. Each run is a fresh process that
loads the engine once and then goes through every scenario: a warm-up with the scenario's own step
shapes, then rounds of its requests until --min-seconds of measured time (decode scenarios: or
--decode-requests requests, whichever comes first). Both engines get the same KV pool, sized from
the scenarios, so the scheduler takes the same steps in both and no run preempts.

Per scenario: output tokens/s per run, the flag/stock ratio of each pair, their median and min-max;
a win or a loss only when every pair agrees (and there are at least 3). The JSON is rewritten after
every run, so a run cut short by a time limit leaves what it measured. JSON + markdown + PNG in
bench/results/ (e2e-interleaved-<model>-tp<N>-<device>-<date>); bench/readme_table.py puts the
newest in the README.

Scenarios (--scenarios a,b,...; --only prefill|decode|mix picks a family):
  prefill-b8, prefill-b32   8 / 32 prompts of 2048 tokens, 16 output tokens each, all at once
  decode-b1 ... decode-b256 128 in / 512 out, batch 1, 16, 64, 256
  mix-c64                   256 requests, lognormal lengths (median 256 in / 128 out, sigma 1, at most
                            2048 in all: a ShareGPT-like long tail made in code), <= 64 in flight
Default: prefill-b32, decode-b64, mix-c64. --quick: tiny ones of each kind, for the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (MIN_PAIRS, add_comparison_args, bench_parser, by_pair, comparison_header,  # noqa: E402
                      exit_on_sigterm, fmt_ratio, grouped_bars, hbm_copy_bandwidth, interleaved, load_payload, log,
                      md_table, median_or_nan, pair_ratios, ratio_chart, report, start_comparison, write_results)

SCHEMA = "e2e-interleaved/1"
SPREAD_TARGET = 1.03


def fixed(batch: int, input_len: int, output_len: int) -> dict:
    return {"kind": "fixed", "batch": batch, "input_len": input_len, "output_len": output_len}


def mix(requests: int, concurrency: int, input_median: int, output_median: int, sigma: float, max_len: int) -> dict:
    return {"kind": "mix", "requests": requests, "concurrency": concurrency, "input_median": input_median,
            "output_median": output_median, "sigma": sigma, "max_len": max_len, "seed": 0}


SCENARIOS = {
    "prefill-b8": fixed(8, 2048, 16),
    "prefill-b32": fixed(32, 2048, 16),
    "decode-b1": fixed(1, 128, 512),
    "decode-b16": fixed(16, 128, 512),
    "decode-b64": fixed(64, 128, 512),
    "decode-b256": fixed(256, 128, 512),
    "mix-c64": mix(256, 64, 256, 128, 1.0, 2048),
}
QUICK = {
    "prefill-q": fixed(4, 24, 4),
    "decode-q": fixed(2, 8, 8),
    "mix-q": mix(8, 4, 8, 6, 0.8, 40),
}
DEFAULT = "prefill-b32,decode-b64,mix-c64"


def lengths(spec: dict) -> list[tuple[int, int]]:
    if spec["kind"] == "fixed":
        return [(spec["input_len"], spec["output_len"])] * spec["batch"]
    from tp_overlap_plugin.serving.benchmarks.workloads import lognormal_lengths
    return lognormal_lengths(spec["requests"], spec["input_median"], spec["output_median"], spec["sigma"],
                             spec["max_len"], spec["seed"])


def concurrency(spec: dict) -> int:
    return spec["batch"] if spec["kind"] == "fixed" else spec["concurrency"]


def describe(spec: dict) -> str:
    if spec["kind"] == "fixed":
        return f"{spec['batch']} x ({spec['input_len']} in, {spec['output_len']} out)"
    return (f"{spec['requests']} req, lognormal in~{spec['input_median']} out~{spec['output_median']} "
            f"sigma {spec['sigma']}, <= {spec['max_len']}, <= {spec['concurrency']} in flight")


def select(args) -> dict[str, dict]:
    pool = QUICK if args.quick else SCENARIOS
    if args.scenarios:
        names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
        unknown = [n for n in names if n not in pool]
        if unknown:
            raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(pool)}")
    elif args.only:
        names = [n for n in pool if n.startswith(args.only)]
    else:
        names = list(pool) if args.quick else DEFAULT.split(",")
    specs = {n: dict(pool[n]) for n in names}
    if args.mix_requests:
        for s in specs.values():
            if s["kind"] == "mix":
                s["requests"] = args.mix_requests
    return specs


def kv_blocks(specs: dict[str, dict], block_size: int = 16) -> int:
    """Enough blocks for the largest set of requests any scenario has in flight at once: no preemption,
    and the same pool (so the same schedule) for both engines, whatever memory the heap takes."""
    need = 0
    for spec in specs.values():
        per_req = sorted((-(-(i + o) // block_size) + 1 for i, o in lengths(spec)), reverse=True)
        need = max(need, sum(per_req[:concurrency(spec)]))
    return need + 8


def run_variant(args, specs: dict[str, dict]) -> None:
    """One engine in this process: load, then every scenario; the results file is rewritten after each
    scenario so that a crash mid-run still reports the finished ones."""
    t_start = time.monotonic()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from tp_overlap_plugin.serving import LLM, EngineConfig
    from tp_overlap_plugin import stats
    from tp_overlap_plugin.serving.benchmarks.offline import measure

    all_lengths = {n: lengths(s) for n, s in specs.items()}
    cfg = EngineConfig(
        model=args.model, tensor_parallel_size=args.tp, device=args.device, show_progress=False,
        max_num_seqs=max(concurrency(s) for s in specs.values()),
        max_model_len=max(i + o for ls in all_lengths.values() for i, o in ls) + 16,
        # vLLM's default step budget: prefill steps of up to 8192 tokens (4 of the 2048-token prompts)
        max_num_batched_tokens=args.max_num_batched_tokens or (64 if args.quick else 8192),
        num_kv_blocks=kv_blocks(specs),
        load_format="dummy" if args.model != "demo" else "auto",
        tp_overlap={"dispatch": args.dispatch, "fused_ops": args.fused_ops} if args.variant == "overlap" else None,
        async_scheduling=args.async_scheduling,
        **(dict(dtype="bfloat16") if args.device == "cpu" else {}))
    out = {"engine": args.variant, "results": {}, "config": json.loads(cfg.model_dump_json())}

    def save():
        out["wall_s"] = time.monotonic() - t_start
        with open(args.variant_out, "w") as f:
            json.dump(out, f)

    tag = f"e2e {args.variant}"
    with LLM(cfg) as llm:
        out["load_s"] = time.monotonic() - t_start
        out["weight_bytes"] = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
        log(tag, f"engine ready in {out['load_s']:.1f} s")
        for k, (name, spec) in enumerate(specs.items()):
            t0 = time.monotonic()
            before = stats.snapshot()
            res = measure(llm, all_lengths[name], seed=10_000 * (k + 1), max_concurrency=concurrency(spec),
                          min_seconds=args.min_seconds,
                          max_requests=args.decode_requests if name.startswith("decode") else None,
                          # a mix's decode batches and contexts vary over the round, and with outputs cut
                          # short its first measured round ran up to 20% slower (2026-11-23, H200x2):
                          # it warms up on a whole round
                          warmup_output_len=None if spec["kind"] == "mix" else 2)
            res["warmup_and_measure_s"] = time.monotonic() - t0
            # which path each op took (rank 0, eager calls and graph captures; replays run no Python),
            # so a ratio can be traced to the kernels that ran
            res["op_paths"] = stats.since(before)
            out["results"][name] = res
            log(tag, f"{name}: {res['output_tokens_per_s']:.1f} out tok/s over {res['elapsed_s']:.1f} s measured, "
                     f"{res['num_requests']} requests in {res.get('rounds', 1)} round(s); "
                     f"{res['warmup_and_measure_s']:.1f} s with the warm-up")
            save()
        if args.device != "cpu" and args.first_run and "decode-b1" in specs:
            out["hbm_copy_bytes_per_s"] = hbm_copy_bandwidth()
    save()


def summarize(runs: list[dict], specs: dict[str, dict], engines: tuple[str, ...]) -> dict:
    """Per scenario: each engine's tok/s per run and, over complete pairs, the flag/stock ratios."""
    summary = {}
    for name, spec in specs.items():
        per, (st, ov) = by_pair(runs, engines, "results", name)
        s = {"workload": describe(spec)}
        for e, got in per.items():
            s[e] = {"output_tokens_per_s": [g["output_tokens_per_s"] for g in got],
                    "measured_s": [g["elapsed_s"] for g in got],
                    "requests": [g["num_requests"] for g in got],
                    "ttft_ms_median": [g["ttft_ms"].get("median") for g in got],
                    "tpot_ms_median": [g["tpot_ms"].get("median") for g in got]}
        if len(engines) == 2:
            s["overlap_over_stock"] = pair_ratios([x["output_tokens_per_s"] for x in st],
                                                  [x["output_tokens_per_s"] for x in ov])
        summary[name] = s
    return summary


def markdown(payload: dict) -> str:
    summary, engines = payload["summary"], tuple(payload["config"]["engines"])
    lines = comparison_header("bench/e2e.py", payload)
    if len(engines) == 2:
        rows = []
        for name, s in summary.items():
            r = s["overlap_over_stock"]
            rows.append([name, s["workload"], median_or_nan(s["stock"]["output_tokens_per_s"]),
                         median_or_nan(s["overlap"]["output_tokens_per_s"]), fmt_ratio(r),
                         f"{r['spread']:.3f}" if r.get("ratios") else "-", r["call"],
                         " ".join(f"{x:.3f}" for x in r["ratios"]),
                         f"{min(s['stock']['measured_s'] + s['overlap']['measured_s'], default=0):.1f}"])
        lines.append(md_table(["scenario", "workload", "stock out tok/s", "overlap out tok/s",
                               "overlap/stock [min–max]", "spread", "call", "per-pair ratios",
                               "shortest run s"], rows))
        spreads = {n: s["overlap_over_stock"]["spread"] for n, s in summary.items()
                   if s["overlap_over_stock"].get("ratios")}
        pairs = min((s["overlap_over_stock"]["pairs"] for s in summary.values()), default=0)
        if spreads and pairs >= MIN_PAIRS:
            worst = max(spreads, key=spreads.get)
            ok = all(v <= SPREAD_TARGET for v in spreads.values())
            lines.append(f"\nRepeat spread (max/min of the per-pair ratios) <= {SPREAD_TARGET} on every scenario: "
                         f"**{'yes' if ok else 'no'}** (widest: {worst}, {spreads[worst]:.3f}).\n")
        else:  # one or two pairs always look tight
            lines.append(f"\nRepeat spread: not judged with fewer than {MIN_PAIRS} pairs.\n")
        lat = [[n] + [median_or_nan(s[e][k]) for k in ("ttft_ms_median", "tpot_ms_median") for e in engines]
               for n, s in summary.items()]
        lines.append("\nLatency, median over runs of each run's median:\n\n" + md_table(
            ["scenario"] + [f"{m} {e} ms" for m in ("TTFT", "TPOT") for e in engines], lat))
    else:
        rows = [[n, s["workload"], median_or_nan(s["stock"]["output_tokens_per_s"]),
                 " ".join(f"{x:.1f}" for x in s["stock"]["output_tokens_per_s"]),
                 median_or_nan(s["stock"]["ttft_ms_median"]), median_or_nan(s["stock"]["tpot_ms_median"])]
                for n, s in summary.items()]
        lines.append(md_table(["scenario", "workload", "out tok/s", "per run", "TTFT ms", "TPOT ms"], rows))
    if payload.get("floor_md"):
        lines.append(payload["floor_md"])
    runs = [[r["pair"] + 1, r["engine"], r.get("load_s", float("nan")), r["process_s"], r.get("error", "")]
            for r in payload["runs"]]
    lines.append("\nRuns in order (load: building the engine, i.e. workers, process group, weights, KV "
                 "cache, CUDA graphs; process: the run's whole process, as the parent saw it):\n\n"
                 + md_table(["pair", "engine", "load s", "process s", "error"], runs))
    return "\n".join(lines)


def decode_floor(payload: dict) -> None:
    """Batch-1 decode step against reading each rank's weights once at the measured copy bandwidth."""
    first = payload["runs"][0] if payload["runs"] else {}
    bw = first.get("hbm_copy_bytes_per_s")
    s = payload["summary"].get("decode-b1")
    if not bw or not s:
        return
    floor_ms = first["weight_bytes"] / bw * 1e3
    step = median_or_nan(s["stock"]["tpot_ms_median"])
    payload["environment"].update(hbm_copy_bytes_per_s=bw, decode_floor_ms=floor_ms)
    payload["floor_md"] = (f"\nBatch-1 decode step (stock, median TPOT): {step:.2f} ms; floor {floor_ms:.2f} ms "
                           f"({first['weight_bytes'] / 1e9:.2f} GB of weights per rank at {bw / 1e12:.2f} TB/s, a "
                           f"device copy measured in this run): **{step / floor_ms:.2f}x the floor**.\n")


def write_outputs(payload: dict, out_dir: str) -> tuple[str, str]:
    paths = write_results(out_dir, payload["name"], payload, markdown(payload))
    png, summary = paths[0].replace(".json", ".png"), payload["summary"]
    if len(payload["config"]["engines"]) == 2:
        ratio_chart(png, list(summary), [s["overlap_over_stock"] for s in summary.values()],
                    f"overlap/stock output tok/s, TP={payload['config']['tp']}")
    else:
        per_run = [s["stock"]["output_tokens_per_s"] for s in summary.values()]
        grouped_bars(png, list(summary), {f"run {i + 1}": [r[i] if i < len(r) else 0 for r in per_run]
                                          for i in range(len(payload["runs"]))}, "output tokens/s")
    return paths


def main(argv=None):
    p = bench_parser(__doc__)
    add_comparison_args(p)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--scenarios", default=None, help=f"comma-separated (default {DEFAULT})")
    p.add_argument("--only", choices=["prefill", "decode", "mix"], help="one family of scenarios")
    p.add_argument("--min-seconds", type=float, default=15.0, help="measured time per scenario and run")
    p.add_argument("--decode-requests", type=int, default=512,
                   help="decode scenarios stop at this many requests if that comes before --min-seconds")
    p.add_argument("--mix-requests", type=int, default=None, help="requests per round of the mix (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="step token budget (default 8192)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="both engines launch step i+1 before step i's tokens reach the host (the engine's default)")
    p.add_argument("--variant", choices=["stock", "overlap"], help=argparse.SUPPRESS)
    p.add_argument("--variant-out", help=argparse.SUPPRESS)
    p.add_argument("--first-run", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.replot:
        print("wrote", *write_outputs(*load_payload(args.replot)))
        return
    specs = select(args)
    if args.variant:
        return run_variant(args, specs)
    exit_on_sigterm()

    payload, engines, _ = start_comparison("e2e", SCHEMA, args, on_gpu=args.device != "cpu")
    payload["config"].update(min_seconds=args.min_seconds, decode_requests=args.decode_requests, scenarios=specs,
                             kv_blocks=kv_blocks(specs), async_scheduling=args.async_scheduling)
    payload["method"] = (
        f"Each scenario >= {args.min_seconds:g} s measured (decode: or >= {args.decode_requests} requests) after a "
        f"warm-up of its own step shapes; both engines with the same {kv_blocks(specs)}-block KV pool. Output "
        f"tokens/s: median over runs; ratio: median over pairs [min–max]; a win or loss only when every pair agrees.")
    child_argv = list(argv if argv is not None else sys.argv[1:])
    plan = interleaved(engines, args.pairs)
    log("e2e", f"{len(plan)} runs: {' '.join(f'{e}#{i + 1}' for i, e in plan)}; scenarios {', '.join(specs)}")
    failed = None
    with tempfile.TemporaryDirectory() as tmp:
        for k, (pair, engine) in enumerate(plan):
            # a fresh process per run: nothing of the previous engine (CUDA context, process group, heap,
            # allocator state) can leak into this one's numbers
            out = os.path.join(tmp, f"{pair}-{engine}.json")
            log("e2e", f"run {k + 1}/{len(plan)}: {engine}, pair {pair + 1}")
            t0 = time.monotonic()
            rc = subprocess.run([sys.executable, os.path.abspath(__file__), *child_argv, "--variant", engine,
                                 "--variant-out", out, *(["--first-run"] if k == 0 else [])]).returncode
            run = {"pair": pair, "engine": engine, "results": {}, "process_s": time.monotonic() - t0}
            if os.path.exists(out):
                with open(out) as f:
                    run.update(json.load(f))
            if rc != 0:
                failed = run["error"] = f"the {engine} process exited with status {rc}"
            payload["runs"].append(run)
            payload["summary"] = summarize(payload["runs"], specs, engines)
            decode_floor(payload)
            paths = write_outputs(payload, args.out)
            if failed:
                break
    report(payload, markdown(payload), paths)
    if failed:
        raise SystemExit(failed)


if __name__ == "__main__":
    main()
