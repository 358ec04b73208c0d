"""The engine's step timeline under HTTP load (issue 29): every step of a request-rate sweep, with its
kind, tokens, sequences, wall time, GPU span and host-exposed time, summarised per rate, and one rate
drawn as a picture.

    python bench/serve_timeline.py --model llama-3-8b --tp 1 --rates 2,8,32,inf
    python bench/serve_timeline.py --model llama-3-8b --tp 1 --rates inf --pairs 2 --base /tmp/site-base
    python bench/serve_timeline.py --model demo --tp 1 --quick          # a logic check on the CPU

One server per run (`tp-overlap serve`, the workload and server options of bench/serve_load.py) with
TP_OVERLAP_STEP_TRACE set, so the engine writes a record per step (serving/engine/step_trace.py says what
each field means). Each level's steps are those the engine entered between the level's first request
and its last response.

Per rate: output tok/s, TTFT, TPOT and ITL as `bench serve` reports them; steps by kind with their
tokens, GPU span and launch time; host-exposed time = the GPU's idle time between steps while the
engine had work, as a share of (exposed + GPU span); and the decode-only step time at the running
batch, to hold TPOT against.

`--base DIR` runs a second engine, another checkout installed at DIR (`pip install --target DIR`), its
server with DIR first on PYTHONPATH, alternately with this one (base, this, base, this, ...): the A/B
of the issue's output tok/s target. The base engine need not write a timeline.

JSON + markdown + PNG in bench/results/ (serve-timeline-<model>-tp<N>[-tag]-<device>-<date>).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (_pyplot, bench_parser, device_slug, environment, load_payload, log, md_table,  # noqa: E402
                      write_results)
from serve_load import STATS, _key, bench_args, level_requests, server_args  # noqa: E402

SCHEMA = "serve-timeline/1"
KINDS = ("prefill", "mixed", "decode")
DECODE_BATCHES = ((1, 8), (32, 95), (96, 128))


def one_run(args, engine: str, pair: int) -> dict:
    from tp_overlap_plugin.serving.benchmarks.serve import run_benchmark
    from tp_overlap_plugin.serving.engine.step_trace import ENV, read_trace
    from tp_overlap_plugin.serving.entrypoints.server_process import ServerProcess

    tag = f"{engine}#{pair + 1}"
    fd, trace = tempfile.mkstemp(prefix="steps-", suffix=".jsonl")
    os.close(fd)
    env = dict(os.environ, **{ENV: trace})
    if engine == "base":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.base, env.get("PYTHONPATH")) if p)
    run = {"pair": pair, "engine": engine, "levels": {}, "windows": {}}
    t0 = time.monotonic()
    with ServerProcess(server_args(args, "stock"), start_timeout=args.startup_timeout, stop_timeout=60,
                       env=env) as srv:
        run["load_s"] = time.monotonic() - t0
        log(tag, f"server healthy after {run['load_s']:.1f} s")
        warm = asyncio.run(run_benchmark(bench_args(args, srv.port, float("inf"), args.warmup_requests, 10_000,
                                                    f"{engine} warm-up")))
        log(tag, f"warm-up: {warm['completed']} requests")
        for k, rate in enumerate(args.rate_list):
            t_begin = time.time()
            res = asyncio.run(run_benchmark(bench_args(args, srv.port, rate, level_requests(args, rate), k,
                                                       f"{engine} rate={rate}")))
            run["windows"][_key(rate)] = (t_begin, time.time())
            run["levels"][_key(rate)] = res
            log(tag, f"rate {_key(rate)}: {res['completed']} requests, {res['output_throughput']:.1f} out tok/s, "
                     f"TTFT p50 {res['median_ttft_ms']:.1f} ms, TPOT p50 {res['median_tpot_ms']:.2f} ms, "
                     f"failed {res['failed']}")
        run["idle"] = idle_probe(args, srv.port, tag)
    steps = read_trace(trace)
    os.unlink(trace)
    run["steps"] = {lv: [s for s in steps if a <= s["t"] <= b] for lv, (a, b) in run["windows"].items()}
    return run


def idle_probe(args, port: int, tag: str) -> dict:
    """The TTFT target's yardstick: the median prompt (--input-len tokens) alone on the idle server, one
    request at a time, two output tokens: its TTFT is the prefill alone (HTTP included), its TPOT one
    decode step at batch 1. Runs after the levels, so every kernel is compiled."""
    from tp_overlap_plugin.serving.benchmarks.serve import run_benchmark
    from tp_overlap_plugin.serving.benchmarks.serve_config import BenchServeConfig
    cfg = BenchServeConfig(port=port, num_prompts=args.idle_requests, max_concurrency=1, dataset_name="random",
                           random_input_len=args.input_len, random_output_len=2, seed=7, label=f"{tag} idle probe",
                           ignore_eos=True)
    res = asyncio.run(run_benchmark(cfg))
    out = {"prompt_len": args.input_len, "requests": res["completed"], "ttft_ms_p50": res["median_ttft_ms"],
           "tpot_ms_p50": res["median_tpot_ms"]}
    out["ttft_bound_ms"] = 1.3 * (out["ttft_ms_p50"] + out["tpot_ms_p50"])
    log(tag, f"idle probe, {args.input_len}-token prompt: TTFT p50 {out['ttft_ms_p50']:.1f} ms, one decode step "
             f"{out['tpot_ms_p50']:.2f} ms -> TTFT bound 1.3 x their sum = {out['ttft_bound_ms']:.1f} ms")
    return out


def _pct(xs: list, q: float) -> float:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _mean(xs: list) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def summarize_steps(steps: list[dict]) -> dict:
    """One level's timeline in numbers (see the module docstring)."""
    if not steps:
        return {"steps": 0}
    out: dict = {"steps": len(steps)}
    # wall time of a step: from its entry to the next step's entry (the last step of a level has none)
    wall = {s["step"]: (b["t"] - s["t"]) * 1e3 for s, b in zip(steps, steps[1:])}
    for kind in KINDS:
        ks = [s for s in steps if s["kind"] == kind]
        out[kind] = {"steps": len(ks), "tokens_mean": _mean([s["tokens"] for s in ks]),
                     "seqs_mean": _mean([s["seqs"] for s in ks]),
                     "gpu_ms_p50": _pct([s.get("gpu_ms") for s in ks], 0.5),
                     "wall_ms_p50": _pct([wall.get(s["step"]) for s in ks], 0.5),
                     "launch_ms_p50": _pct([s["launch_ms"] for s in ks], 0.5),
                     "build_ms_p50": _pct([s["build_ms"] for s in ks], 0.5),
                     "exposed_ms_sum": sum(s.get("exposed_ms") or 0.0 for s in ks),
                     "graph_share": _mean([float(s["graph"]) for s in ks])}
    gpu = sum(s.get("gpu_ms") or 0.0 for s in steps)
    exposed = sum(s.get("exposed_ms") or 0.0 for s in steps)
    out["gpu_ms_sum"], out["exposed_ms_sum"] = gpu, exposed
    out["exposed_share"] = exposed / (exposed + gpu) if gpu else float("nan")
    out["tokens_per_step"] = _mean([s["tokens"] for s in steps])
    # decode-only step time at the level's typical running batch: what TPOT would be without prefills
    dec = [s for s in steps if s["kind"] == "decode"]
    # the batch a decoded token ran in (the median over decode tokens, not over steps: the tail of a
    # level is many steps of one or two sequences)
    by_batch = sorted((s["seqs"], s["decodes"]) for s in steps if s["decodes"])
    half, acc, batch = sum(w for _, w in by_batch) / 2, 0, float("nan")
    for b, w in by_batch:
        acc += w
        if acc >= half:
            batch = b
            break
    near = [wall.get(s["step"]) for s in dec if abs(s["seqs"] - batch) <= max(4, batch / 8)]
    out["running_batch_p50"] = batch
    # host launch time of graph decodes by running batch: where the host, not the GPU, sets the step
    out["decode_launch_by_batch"] = {}
    for lo, hi in DECODE_BATCHES:
        ks = [s for s in dec if lo <= s["seqs"] <= hi and s["graph"] and s.get("gpu_ms")]
        if len(ks) >= 5:
            out["decode_launch_by_batch"][f"{lo}-{hi}"] = {"steps": len(ks), "launch_ms_p50": _pct([s["launch_ms"] for s in ks], 0.5),
                                                          "gpu_ms_p50": _pct([s["gpu_ms"] for s in ks], 0.5)}
    # Output tok/s over a level is set by its slowest request once the lognormal tail runs alone; the
    # engine's throughput while it is loaded is the decode tokens of the steps that ran at least half
    # the level's peak batch, over those steps' wall time.
    peak = max(s["seqs"] for s in steps)
    loaded = [s for s in steps if s["seqs"] * 2 >= peak and s["step"] in wall]
    loaded_ms = sum(wall[s["step"]] for s in loaded)
    out["loaded_batch_min"] = -(-peak // 2)
    out["loaded_decode_tok_s"] = sum(s["decodes"] for s in loaded) / (loaded_ms / 1e3) if loaded_ms else float("nan")
    out["loaded_share_of_wall"] = loaded_ms / sum(wall.values()) if wall else float("nan")
    out["decode_step_ms_at_batch"] = _pct(near, 0.5)
    paths: dict = {}
    for s in steps:
        for k, n in s.get("paths", {}).items():
            paths[k] = paths.get(k, 0) + n
    out["op_paths"] = paths
    # Triton kernel variants built mid-serving: each is a stalled step (serving/engine/step_trace.py)
    out["compiles"] = [{"step": s["step"], "kind": s["kind"], "tokens": s["tokens"], "seqs": s["seqs"],
                        "decodes": s["decodes"], "graph": s["graph"], "launch_ms": s["launch_ms"],
                        "kernels": s["compiles"]} for s in steps if s.get("compiles")]
    return out


def summarize(payload: dict) -> dict:
    summary = {}
    for lv in payload["config"]["rates"]:
        per = {}
        for e in payload["config"]["engines"]:
            runs = [r for r in payload["runs"] if r["engine"] == e and lv in r["levels"]]
            per[e] = {k: [r["levels"][lv][k] for r in runs] for k, _ in STATS}
            per[e]["timeline"] = [summarize_steps(r["steps"][lv]) for r in runs]
        if "base" in per:
            a, b = per["base"]["output_throughput"], per["this"]["output_throughput"]
            per["ratio_tok_s"] = [y / x for x, y in zip(a, b) if x]
            a, b = ([t.get("loaded_decode_tok_s", float("nan")) for t in per[e]["timeline"]] for e in ("base", "this"))
            per["ratio_loaded_tok_s"] = [y / x for x, y in zip(a, b) if x and not math.isnan(x) and not math.isnan(y)]
        summary[lv] = per
    return summary


def _med(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else float("nan")


def markdown(payload: dict) -> str:
    c = payload["config"]
    lines = [f"# Step timeline under HTTP load: {c['model']}, TP={c['tp']}\n",
             f"Command: `{payload['command']}`\n", payload["method"] + "\n"]
    if payload.get("note"):   # what the numbers are of, added after the run
        lines.append(f"**Note:** {payload['note']}\n")
    rows, tl_rows, kind_rows = [], [], []
    for lv, per in payload["summary"].items():
        for e in c["engines"]:
            s = per[e]
            rows.append([lv, e] + [_med(s[k]) for k, _ in STATS] +
                        ([f"{_med(per['ratio_tok_s']):.3f} {['%.3f' % r for r in per['ratio_tok_s']]}"]
                         if "ratio_tok_s" in per and e == "this" else ["-"] if "ratio_tok_s" in per else []))
            tls = [t for t in s["timeline"] if t.get("steps")]
            if not tls:
                continue
            tl_rows.append([lv, e, _med([t["steps"] for t in tls]), _med([t["tokens_per_step"] for t in tls]),
                            _med([t["running_batch_p50"] for t in tls]), _med([t["gpu_ms_sum"] for t in tls]),
                            _med([t["exposed_ms_sum"] for t in tls]),
                            f"{100 * _med([t['exposed_share'] for t in tls]):.2f}%",
                            _med([t["decode_step_ms_at_batch"] for t in tls]), _med(s["median_tpot_ms"]),
                            _med([t.get("loaded_decode_tok_s") for t in tls]),
                            _med([t.get("loaded_share_of_wall") for t in tls])])
            for kind in KINDS:
                ks = [t[kind] for t in tls]
                kind_rows.append([lv, e, kind, _med([k["steps"] for k in ks]), _med([k["tokens_mean"] for k in ks]),
                                  _med([k["seqs_mean"] for k in ks]), _med([k["wall_ms_p50"] for k in ks]),
                                  _med([k["gpu_ms_p50"] for k in ks]), _med([k["build_ms_p50"] for k in ks]),
                                  _med([k["launch_ms_p50"] for k in ks]), _med([k["exposed_ms_sum"] for k in ks]),
                                  _med([k["graph_share"] for k in ks])])
    launch_rows = [[lv, r["engine"], r["pair"] + 1, b, x["steps"], x["launch_ms_p50"], x["gpu_ms_p50"],
                    x["launch_ms_p50"] / x["gpu_ms_p50"]]
                   for lv, per in payload["summary"].items() for e in c["engines"]
                   for r, t in zip([r for r in payload["runs"] if r["engine"] == e and lv in r["levels"]],
                                   per[e]["timeline"])
                   for b, x in t.get("decode_launch_by_batch", {}).items()]
    head = ["rate", "engine"] + [t for _, t in STATS] + (["tok/s this/base"] if "base" in c["engines"] else [])
    lines.append("HTTP (median over runs; ms):\n\n" + md_table(head, rows))
    idle = [[r["engine"], r["pair"] + 1, r["idle"]["prompt_len"], r["idle"]["ttft_ms_p50"], r["idle"]["tpot_ms_p50"],
             r["idle"]["ttft_bound_ms"]] for r in payload["runs"] if r.get("idle")]
    if idle:
        lines.append("\nIdle probe after the levels (one request at a time; the TTFT target at rate 2 is "
                     "<= 1.3 x (prefill alone + one decode step)):\n\n" + md_table(
                         ["engine", "run", "prompt tokens", "TTFT p50 ms (prefill alone)", "TPOT p50 ms (one decode step)",
                          "TTFT bound ms"], idle))
    loaded = [f"rate {lv}: {_med(per['ratio_loaded_tok_s']):.3f} {['%.3f' % r for r in per['ratio_loaded_tok_s']]}"
              for lv, per in payload["summary"].items() if per.get("ratio_loaded_tok_s")]
    if loaded:
        lines.append("\nDecode tok/s while the batch is at least half its peak, this/base: " + "; ".join(loaded) + "\n")
    lines.append("\nTimeline per level (median over runs):\n\n" + md_table(
        ["rate", "engine", "steps", "tokens/step", "running batch (p50 over decoded tokens)", "GPU span ms",
         "host-exposed ms", "host-exposed share", "decode-only step ms at that batch", "TPOT p50 ms",
         "decode tok/s while >= half the peak batch runs", "share of the level's wall"], tl_rows))
    lines.append("\nSteps by kind (p50 per step unless a sum):\n\n" + md_table(
        ["rate", "engine", "kind", "steps", "tokens", "seqs", "wall ms", "GPU span ms", "build ms", "launch ms",
         "exposed ms (sum)", "graph share"], kind_rows))
    compile_rows = [[lv, r["engine"], r["pair"] + 1, x["kind"], x["tokens"], x["seqs"], x["decodes"], x["graph"],
                     x["launch_ms"], "; ".join(k.split("[")[0] for k in x["kernels"])]
                    for lv, per in payload["summary"].items() for e in c["engines"]
                    for r, t in zip([r for r in payload["runs"] if r["engine"] == e and lv in r["levels"]],
                                    per[e]["timeline"])
                    for x in t.get("compiles", [])]
    lines.append(f"\nSteps that built a Triton kernel while serving: {len(compile_rows)}"
                 + (" (the kernels' specialisations are in the JSON's timeline `compiles`):\n\n" + md_table(
                     ["rate", "engine", "run", "kind", "tokens", "seqs", "decodes", "graph", "launch ms", "kernels"],
                     compile_rows) if compile_rows else "\n"))
    if launch_rows:
        lines.append("\nGraph decodes by running batch (p50; launch: host time to queue the step):\n\n" + md_table(
            ["rate", "engine", "run", "batch", "steps", "launch ms", "GPU span ms", "launch / GPU"], launch_rows))
    return "\n".join(lines)


def plot(path: str, payload: dict, level: str) -> str | None:
    """The steps of one level over time: tokens per step by kind, and each step's GPU span and
    host-exposed time."""
    plt = _pyplot()
    run = next((r for r in payload["runs"] if r["engine"] == "this" and r["steps"].get(level)), None)
    if plt is None or run is None:
        return None
    steps = run["steps"][level]
    t0 = steps[0]["t"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    colors = {"prefill": "tab:red", "mixed": "tab:orange", "decode": "tab:blue"}
    for kind in KINDS:
        ks = [s for s in steps if s["kind"] == kind]
        ax1.scatter([s["t"] - t0 for s in ks], [s["tokens"] for s in ks], s=6, c=colors[kind], label=kind)
        ax2.scatter([s["t"] - t0 for s in ks], [s.get("gpu_ms") or 0 for s in ks], s=6, c=colors[kind],
                    label=f"{kind}: GPU span")
    ax2.scatter([s["t"] - t0 for s in steps], [s.get("exposed_ms") or 0 for s in steps], s=6, c="black", marker="x",
                label="host-exposed (GPU idle before the step)")
    ax1.set_yscale("log")
    ax1.set_ylabel("tokens in the step")
    ax2.set_ylabel("ms")
    ax2.set_yscale("symlog", linthresh=0.1)
    ax2.set_xlabel("seconds into the level")
    ax1.legend(loc="upper right", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ax1.set_title(f"{payload['config']['model']} TP={payload['config']['tp']}, rate {level}: every engine step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    from serve_load import add_workload_args, apply_quick
    p = bench_parser(__doc__)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--rates", default="2,8,32,inf")
    p.add_argument("--plot-rate", default=None, help="the level drawn (default: the last)")
    p.add_argument("--pairs", type=int, default=1)
    p.add_argument("--base", default=None, help="a folder holding another checkout's install: A/B against it")
    p.add_argument("--tag", default="")
    p.add_argument("--idle-requests", type=int, default=8,
                   help="requests of the idle probe after the levels (the TTFT target's yardstick)")
    p.add_argument("--replot", metavar="JSON", help="only recompute the summary, markdown and plot of a results file")
    add_workload_args(p)
    args = p.parse_args(argv)
    if args.replot:
        payload, folder = load_payload(args.replot)
        payload["summary"] = summarize(payload)
        env = payload["environment"]
        payload.setdefault("name", os.path.basename(args.replot)[:-len(f"-{device_slug(env)}-{env['date']}.json")])
        paths = write_results(folder, payload["name"], payload, markdown(payload), compact=True)
        level = args.plot_rate or payload["config"]["rates"][-1]
        print("wrote", *paths, plot(paths[0].replace(".json", f"-rate{level}.png"), payload, level))
        return 0
    args.dispatch = "table"
    apply_quick(args)
    if args.quick:
        args.idle_requests = min(args.idle_requests, 2)
    args.rate_list = [float(r) for r in args.rates.split(",")]
    engines = ["base", "this"] if args.base else ["this"]
    import torch
    payload = {"schema": SCHEMA, "environment": environment(args.tp, torch.cuda.is_available(), model=args.model),
               "command": " ".join(["python", "bench/serve_timeline.py"]
                                   + list(argv if argv is not None else sys.argv[1:])),
               "config": {"model": args.model, "tp": args.tp, "rates": [_key(r) for r in args.rate_list],
                          "engines": engines, "pairs": args.pairs, "input_len": args.input_len,
                          "output_len": args.output_len, "max_len": args.max_len, "max_num_seqs": args.max_num_seqs,
                          "max_num_batched_tokens": args.max_num_batched_tokens, "level_seconds": args.level_seconds,
                          "inf_requests": args.inf_requests, "server_args": server_args(args, "stock")},
               "runs": [], "name": f"serve-timeline-{args.model}-tp{args.tp}" + (f"-{args.tag}" if args.tag else "")}
    payload["method"] = (f"Lognormal mix (median {args.input_len} in / {args.output_len} out, <= {args.max_len}), "
                         f"Poisson arrivals for {args.level_seconds:g} s per finite rate (at least {args.min_requests} "
                         f"requests), {args.inf_requests} at once at rate inf; --max-num-seqs {args.max_num_seqs}, "
                         f"--max-num-batched-tokens {args.max_num_batched_tokens}; runs in order "
                         f"{' '.join(e for _ in range(args.pairs) for e in engines)}.")
    for pair in range(args.pairs):
        for e in engines:
            payload["runs"].append(one_run(args, e, pair))
            payload["summary"] = summarize(payload)
            paths = write_results(args.out, payload["name"], payload, markdown(payload), compact=True)
    level = args.plot_rate or payload["config"]["rates"][-1]
    png = plot(paths[0].replace(".json", f"-rate{level}.png"), payload, level)
    print(markdown(payload))
    print("wrote", *paths, png or "(no plot: matplotlib missing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
