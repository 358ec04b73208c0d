"""Where a prefill step's time goes, against the bf16 GEMM roofline measured in the same run (issue 16).

    python bench/prefill_profile.py --model llama-3-8b --tp 2 [--tp-overlap] [--tag stock|overlap]
    python bench/prefill_profile.py --model llama-3-70b --tp 4 --prompts 32 [--tp-overlap] [--tag stock|overlap]
    python bench/prefill_profile.py --model demo --device cpu --prompts 2 --prompt-len 24 \
        --max-num-batched-tokens 16 --warmup 1 --rounds 1      # a logic check on the CPU

One engine in this process (dummy weights, prefix caching off). Steps are synchronous by default, so a
step's wall time holds its GPU time; with --async-scheduling the engine builds and launches step i+1
while step i runs, as it serves, and the profiled round's host-exposed share is 1 - GPU busy / round
wall (the GPU's idle time while the round ran, the first step's build included). A round submits --prompts prompts of --prompt-len tokens, one output token
each; the scheduler cuts the round into steps of --max-num-batched-tokens tokens. After --warmup
rounds, --rounds rounds are timed step by step, and one more runs under torch.profiler (kernel time
per category, sorted as decode_profile.py sorts a decode step).

Work per round on this rank: 2 x tokens x (the decoder layers' matrix parameters of this rank) for the
linear layers, and causal attention, 4 x heads x head_dim x L(L+1)/2 per prompt and layer (QK^T and
PV). The roofline is cuBLAS (torch.matmul, bf16) on this model's largest layer shard, gate_up, at the
step's token count, timed in the same run. Efficiency = the round's FLOPs / (its time x roofline).

JSON + markdown in bench/results/ (prefill-profile-<model>-tp<N>[-tag]-<device>-<date>).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import environment, log, md_table, time_per_call_ms, write_results  # noqa: E402
from decode_profile import (CATEGORIES, add_engine_args, device_events, kernel_breakdown,  # noqa: E402
                            merged, overlap_config, resolve_device)

SCHEMA = "prefill-profile/1"


def layer_matrix_params(model) -> int:
    """The decoder layers' matrix parameters on this rank (what every prefill token multiplies)."""
    return sum(p.numel() for name, p in model.named_parameters() if ".layers." in f".{name}" and p.dim() == 2)


def round_flops(mcfg, tp: int, prompts: int, prompt_len: int, matrix_params: int) -> dict:
    tokens = prompts * prompt_len
    heads = mcfg.num_heads // tp
    attention = prompts * mcfg.num_layers * 4 * heads * mcfg.head_dim * prompt_len * (prompt_len + 1) / 2
    return {"linear": 2 * tokens * matrix_params, "attention": attention}


def gemm_roofline(mcfg, tp: int, tokens: int) -> dict:
    """cuBLAS bf16 FLOP/s on the gate_up shard [tokens, hidden] x [hidden, 2 x intermediate / tp]."""
    import torch
    k, n = mcfg.hidden_size, 2 * mcfg.intermediate_size // tp
    a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = time_per_call_ms(lambda: a @ b, calls=10, samples=7)
    return {"m": tokens, "k": k, "n": n, "ms": ms, "flops_per_s": 2 * tokens * k * n / (ms / 1e3)}


def run_round(eng, prompts: int, prompt_len: int, seed: int) -> list[float]:
    """One round; the wall time of each of its steps, ms."""
    import torch

    from tp_overlap_plugin.serving import SamplingParams
    g = torch.Generator().manual_seed(seed)
    vocab = eng.mcfg.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(prompts):
        eng.add_request(None, torch.randint(10, vocab, (prompt_len,), generator=g).tolist(), params)
    steps = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        steps.append((time.perf_counter() - t) * 1e3)
    return steps


def measure(args, payload: dict) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tp_overlap_plugin import stats
    from tp_overlap_plugin.serving import LLM, EngineConfig
    cfg = EngineConfig(
        model=args.model, tensor_parallel_size=args.tp, device=args.device, show_progress=False,
        load_format="dummy" if args.model != "demo" else "auto", max_num_seqs=args.prompts,
        max_model_len=args.prompt_len + 8, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False, async_scheduling=args.async_scheduling, cuda_graph_batch_sizes=[1],
        tp_overlap=overlap_config(args))
    payload["config"]["engine"] = json.loads(cfg.model_dump_json())
    on_gpu = args.device == "cuda"
    # before the engine: with its process group up, the timer's barrier would wait for the workers
    roof = gemm_roofline(cfg.load_model_config(), args.tp, args.max_num_batched_tokens) if on_gpu else None
    t0 = time.monotonic()
    with LLM(cfg) as llm:
        eng = llm.engine
        payload["load_s"] = time.monotonic() - t0
        mcfg = eng.mcfg
        flops = round_flops(mcfg, args.tp, args.prompts, args.prompt_len, layer_matrix_params(eng.runner.model))
        for i in range(args.warmup):
            run_round(eng, args.prompts, args.prompt_len, seed=i)
        rounds = [run_round(eng, args.prompts, args.prompt_len, seed=100 + i) for i in range(args.rounds)]
        activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
        before = stats.snapshot()
        with tempfile.TemporaryDirectory() as tmp:
            with profile(activities=activities) as prof:
                t_round = time.perf_counter()
                profiled = run_round(eng, args.prompts, args.prompt_len, seed=999)
                if on_gpu:
                    torch.cuda.synchronize()
                profiled_ms = (time.perf_counter() - t_round) * 1e3
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            events = device_events(path)
            breakdown = kernel_breakdown(events, len(profiled))
        # which path each op took in the profiled round (rank 0): the layout and kernels behind the times
        op_paths = stats.since(before)
    round_ms = [sum(r) for r in rounds]
    res = {"steps_per_round": len(rounds[0]), "step_ms": rounds, "round_ms_median": statistics.median(round_ms),
           "step_ms_median": statistics.median(s for r in rounds for s in r), "flops_per_round": flops,
           "roofline": roof, "op_paths": op_paths, "profiled_round_ms": profiled_ms, **breakdown}
    res["host_exposed_share"] = (max(0.0, 1 - breakdown["gpu_busy_ms_per_step"] * len(profiled) / profiled_ms)
                                 if on_gpu else None)
    total = flops["linear"] + flops["attention"]
    res["achieved_flops_per_s"] = total / (res["round_ms_median"] / 1e3)
    res["efficiency"] = res["achieved_flops_per_s"] / roof["flops_per_s"] if roof else None
    res["gemm_efficiency"] = (flops["linear"] / (breakdown["ms_per_step"]["GEMM"] * len(profiled) / 1e3)
                              / roof["flops_per_s"] if roof and breakdown["ms_per_step"]["GEMM"] else None)
    if on_gpu and events:
        res["partition"] = partition(events, profiled_ms)
    if args.events and events:
        # the profiled round's kernels in order (name, start and length in us from the first, stream), to
        # place each op, collective and gap of a layer against the op bench's prediction
        t0 = min(e["ts"] for e in events)
        res["events"] = [[e["name"][:80], round(e["ts"] - t0, 1), round(e["dur"], 1), _stream(e)]
                         for e in sorted(events, key=lambda e: e["ts"])]
    payload["result"] = res
    log("prefill", f"{res['steps_per_round']} steps per round, round {res['round_ms_median']:.1f} ms, "
        f"{res['achieved_flops_per_s'] / 1e12:.0f} TFLOP/s" +
        (f", host-exposed {100 * res['host_exposed_share']:.1f}%" if on_gpu else "") + (f", {res['efficiency']:.2f} of the roofline "
                                                               f"{roof['flops_per_s'] / 1e12:.0f}" if roof else ""))


def _stream(event: dict):
    return event.get("args", {}).get("stream", event.get("tid"))


# what the fused ops' pull streams run: the copy engine's peer copies and the waits for a peer's ready word
PULL_KERNELS = ("Memcpy PtoP", "wait_ready_kernel")


def partition(events: list[dict], wall_ms: float) -> dict:
    """The profiled round's wall time cut into parts that add up to it exactly (ms): `ends`, before its
    first kernel and after its last (the host building the first step, and the round's end); `main`, the
    union in time of the step's own kernels (every kernel but the pulls and their waits, PULL_KERNELS);
    `side_only`, time only the pulls or their waits run (the step waits for them); `idle`, time nothing
    runs, with its gaps counted by length. By kind, not by stream: a CUDA graph's replay runs its
    branches on streams of the executor's own (258 stream ids in one round, H200x4 2026-11-28), so
    the stream a kernel was captured on is not in the trace."""
    if not events:
        return {}

    def union(evs):
        return merged([(e["ts"], e["ts"] + e["dur"]) for e in evs])
    main = union([e for e in events if not e["name"].startswith(PULL_KERNELS)])
    every = union(events)
    span = every[-1][1] - every[0][0]
    busy, main_us = sum(b - a for a, b in every), sum(b - a for a, b in main)
    gaps = {"<5us": [0, 0.0], "5-20us": [0, 0.0], ">=20us": [0, 0.0]}
    for (_, a), (b, _) in zip(every, every[1:]):  # where no stream runs anything
        g = gaps["<5us" if b - a < 5 else "5-20us" if b - a < 20 else ">=20us"]
        g[0] += 1
        g[1] += (b - a) / 1e3
    return {"wall_ms": wall_ms, "ends_ms": wall_ms - span / 1e3, "main_ms": main_us / 1e3,
            "side_only_ms": (busy - main_us) / 1e3, "idle_ms": (span - busy) / 1e3, "idle_gaps": gaps,
            "streams": len({_stream(e) for e in events})}


def markdown(payload: dict) -> str:
    c, r = payload["config"], payload.get("result")
    lines = [f"# Prefill step profile: {c['model']}, TP={c['tp']}, {'--tp-overlap' if c['tp_overlap'] else 'stock'}\n",
             f"Command: `{payload['command']}`\n",
             f"A round: {c['prompts']} prompts x {c['prompt_len']} tokens, steps of {c['max_num_batched_tokens']} "
             f"tokens, {'async scheduling' if c.get('async_scheduling') else 'synchronous steps'}.\n"]
    if not r:
        return "\n".join(lines)
    roof = r["roofline"]
    f = r["flops_per_round"]
    lines.append(md_table(
        ["steps/round", "round ms", "step ms", "TFLOP/round (linear + attention)", "achieved TFLOP/s",
         "cuBLAS roofline TFLOP/s", "step efficiency", "GEMM kernels' efficiency"],
        [[r["steps_per_round"], r["round_ms_median"], r["step_ms_median"],
          f"{f['linear'] / 1e12:.1f} + {f['attention'] / 1e12:.1f}", r["achieved_flops_per_s"] / 1e12,
          roof["flops_per_s"] / 1e12 if roof else "-", r["efficiency"] if r["efficiency"] else "-",
          r["gemm_efficiency"] if r["gemm_efficiency"] else "-"]]))
    if roof:
        lines.append(f"roofline: torch.matmul bf16 [{roof['m']}, {roof['k']}] x [{roof['k']}, {roof['n']}], "
                     f"{roof['ms']:.3f} ms.\n")
    lines.append("Kernel time per step, ms (profiled round):\n")
    ms = r["ms_per_step"]
    lines.append(md_table([*CATEGORIES, "GPU busy", "step wall", "host-exposed share (profiled round)"],
                          [[*[ms[k] for k in CATEGORIES], r["gpu_busy_ms_per_step"], r["step_ms_median"],
                            f"{100 * r['host_exposed_share']:.1f}%" if r.get("host_exposed_share") is not None else "-"]]))
    part = r.get("partition")
    if part:
        g = part["idle_gaps"]
        lines.append("\nThe profiled round's wall, cut into parts that add up to it (ms; rank 0): the round's two ends "
                     "(host, before the first kernel and after the last), the step's own kernels, only the fused ops' "
                     "pulls or their waits running, and nothing running (its gaps by length):\n")
        lines.append(md_table(["wall", "ends", "the step's kernels", "only pulls and their waits", "nothing runs",
                               "gaps < 5 us", "5-20 us", ">= 20 us"],
                              [[part["wall_ms"], part["ends_ms"], part["main_ms"], part["side_only_ms"], part["idle_ms"],
                                *[f"{g[k][0]} ({g[k][1]:.2f} ms)" for k in ("<5us", "5-20us", ">=20us")]]]))
    lines.append("\nOp paths in the profiled round (rank 0): " + (", ".join(f"{k} {n}" for k, n in sorted(r["op_paths"].items()))
                                                              or "none recorded") + "\n")
    lines.append("\nTop kernels:\n")
    lines.append(md_table(["kernel", "category", "ms/step", "calls/step"],
                          [[k["name"][:90], k["category"], k["ms_per_step"], k["calls_per_step"]]
                           for k in r["top_kernels"][:12]]))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--async-scheduling", action="store_true",
                   help="build step i+1 while step i runs, as the server does (default: synchronous steps)")
    p.add_argument("--events", action="store_true",
                   help="keep the profiled round's kernel sequence (name, start, length, stream) in the JSON")
    add_engine_args(p)
    args = p.parse_args(argv)
    resolve_device(args)
    payload = {"schema": SCHEMA, "environment": environment(args.tp, args.device == "cuda"),
               "command": " ".join(["python", "bench/prefill_profile.py"] + list(argv if argv is not None else sys.argv[1:])),
               "config": {k: getattr(args, k) for k in ("model", "tp", "prompts", "prompt_len", "max_num_batched_tokens",
                                                        "warmup", "rounds", "tp_overlap", "dispatch",
                                                        "async_scheduling")}}
    measure(args, payload)
    name = f"prefill-profile-{args.model}-tp{args.tp}" + (f"-{args.tag}" if args.tag else "")
    print("\n".join(f"wrote {x}" for x in write_results(args.out, name, payload, markdown(payload))))


if __name__ == "__main__":
    main()
