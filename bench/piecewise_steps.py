"""Eager against piecewise-CUDA-graph steps (serving/piecewise.py), side by side on one engine (issue 29
item 3): a mixed step (a prompt chunk + decodes), a short prefill and a full-budget prefill.

    python bench/piecewise_steps.py --model llama-3-8b             # one GPU, TP=1
    python bench/piecewise_steps.py --model demo --device cpu --mixed 3x5 --prefill 7 --budget 16 \
        --rounds 2                                                 # a logic check on the CPU (eager both)

One engine (dummy weights) with its graphs captured at start (capture time and memory recorded). Each
step is built by hand (block tables over distinct blocks of the cache) and run through the runner's
two paths, `_forward` (eager) and `_forward_piecewise`, alternately A B A B, --rounds times each:
  * host ms: the call's own time, without waiting for the device (what the host spends launching);
  * GPU ms: CUDA events around the call (the device's span of the step);
  * back-to-back ms: --burst calls in a row, then one synchronisation, per call (the step rate when
    the host queues ahead: the larger of host and GPU time).
The logits of the two paths are compared too (bf16: small differences from cuBLAS's per-M choices).

JSON + markdown in bench/results/ (piecewise-steps-<model>-tp1-<device>-<date>).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import environment, md_table, publish  # noqa: E402

SCHEMA = "piecewise-steps/1"
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build_steps(args, block_size: int, vocab: int, num_blocks: int) -> dict:
    """name -> StepInput, over distinct cache blocks (contents do not matter for timing)."""
    import torch

    from tp_overlap_plugin.serving.step_message import StepInput
    g = torch.Generator().manual_seed(0)
    next_block = [0]

    def table(ctx: int) -> list[int]:
        n = -(-ctx // block_size)
        start = next_block[0]
        next_block[0] += n
        if next_block[0] > num_blocks:
            raise ValueError(f"the steps need more than the cache's {num_blocks} blocks; lower --mixed/--prefill")
        return list(range(start, start + n))

    def step(decode_ctx: list[int], prompts: list[int]) -> StepInput:
        q = [1] * len(decode_ctx) + prompts
        ctx = decode_ctx + prompts
        ids = torch.randint(10, vocab, (sum(q),), generator=g).tolist()
        rows = list(range(len(decode_ctx))) + [len(decode_ctx) + sum(prompts[:i + 1]) - 1 for i in range(len(prompts))]
        return StepInput(ids, q, ctx, [table(c) for c in ctx], num_decodes=len(decode_ctx), logit_rows=rows)

    d, c = map(int, args.mixed.split("x"))
    steps = {f"mixed {c} + {d} decodes": step([200 + (7 * i) % 800 for i in range(d)], [c]),
             f"prefill {args.prefill}": step([], [args.prefill])}
    if args.budget:
        per = args.budget // 4
        steps[f"prefill {args.budget} (4 x {per})"] = step([], [per] * 4)
        steps[f"prefill 2048 (4 x 512)"] = step([], [512] * 4)
    return steps


def measure(args, payload: dict) -> None:
    import torch

    from tp_overlap_plugin.serving import EngineConfig, LLMEngine
    cuda = args.device == "cuda"
    cfg = EngineConfig(model=args.model, load_format="dummy" if args.model != "demo" else "auto", device=args.device,
                       dtype="bfloat16" if cuda else "float32", max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.budget, enable_prefix_caching=False, show_progress=False,
                       piecewise_graph_token_counts=([int(c) for c in args.token_counts.split(",")]
                                                     if args.token_counts else None),
                       **({"max_model_len": args.max_model_len} if args.max_model_len else {}))
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    t0 = time.perf_counter()
    eng = LLMEngine(cfg)
    r = eng.runner
    payload["startup_s"] = time.perf_counter() - t0
    if r.piecewise is None:          # the CPU: the same segments, eagerly
        r.piecewise = r._piecewise(capture=False)
    pw = r.piecewise
    payload["piecewise"] = {"buckets": pw.counts, "segments": r.model.num_segments, "capture_s": pw.capture_s,
                            "pool_reserved_mib": pw.pool_bytes / 2**20,
                            "graphs": sum(len(g) for g in pw.graphs.values()),
                            "static_buffers_mib": sum(t.numel() * t.element_size() for t in
                                                      (pw.inputs, pw.q, pw.attn_out, pw.hidden)) / 2**20}
    if cuda:
        payload["memory"] = {"reserved_after_start_mib": torch.cuda.memory_reserved() / 2**20,
                             "device_used_by_engine_mib": (free0 - torch.cuda.mem_get_info()[0]) / 2**20,
                             "kv_blocks": r.num_blocks}
    steps = build_steps(args, r.block_size, r.mcfg.vocab_size, r.num_blocks)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def call(mode, step):
        bucket = pw.bucket(len(step.input_ids))
        if mode == "eager" or bucket is None:   # beyond the buckets the engine runs the step eagerly too
            return r._forward(step, r.kv_caches)
        return r._forward_piecewise(step, bucket)

    rows = []
    for name, step in steps.items():
        n = len(step.input_ids)
        res = {"step": name, "tokens": n, "bucket": pw.bucket(n)}
        logits = {}
        for mode in ("eager", "piecewise"):   # warm both (prefill attention compiles on its first call)
            for _ in range(2):
                logits[mode] = call(mode, step).float()
            sync()
        res["max_abs_logit_diff"] = (logits["eager"] - logits["piecewise"]).abs().max().item()
        samples = {m: {"host": [], "gpu": [], "burst": []} for m in ("eager", "piecewise")}
        for _ in range(args.rounds):
            for mode in ("eager", "piecewise"):
                s = samples[mode]
                sync()
                if cuda:
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                t = time.perf_counter()
                call(mode, step)
                s["host"].append((time.perf_counter() - t) * 1e3)
                if cuda:
                    e1.record()
                    e1.synchronize()
                    s["gpu"].append(e0.elapsed_time(e1))
                sync()
                t = time.perf_counter()
                for _ in range(args.burst):
                    call(mode, step)
                sync()
                s["burst"].append((time.perf_counter() - t) * 1e3 / args.burst)
        for mode, s in samples.items():
            for k, v in s.items():
                res[f"{mode}_{k}_ms"] = statistics.median(v) if v else float("nan")
        res["burst_ratio_piecewise_over_eager"] = res["piecewise_burst_ms"] / res["eager_burst_ms"]
        rows.append(res)
        print(res, flush=True)
    payload["steps"] = rows


def markdown(payload: dict) -> str:
    env, pw = payload["environment"], payload["piecewise"]
    lines = [f"# Eager vs piecewise CUDA graphs, {payload['config']['model']} TP=1, {env['device']}\n",
             f"{env.get('date')}, torch {env.get('torch')}, Triton {env.get('triton')}. "
             f"`{payload['command']}`. Medians of {payload['config']['rounds']} rounds, A B A B.\n",
             md_table(["step", "tokens", "bucket", "eager host", "eager GPU", "eager back-to-back",
                       "piecewise host", "piecewise GPU", "piecewise back-to-back", "pw/eager (b2b)",
                       "max abs logit diff"],
                      [[s["step"], s["tokens"], s["bucket"], s["eager_host_ms"], s["eager_gpu_ms"], s["eager_burst_ms"],
                        s["piecewise_host_ms"], s["piecewise_gpu_ms"], s["piecewise_burst_ms"],
                        s["burst_ratio_piecewise_over_eager"], s["max_abs_logit_diff"]] for s in payload["steps"]]),
             f"\nGraphs: {len(pw['buckets'])} buckets x {pw['segments']} segments ({pw['graphs']} graphs), captured in "
             f"{pw['capture_s']:.1f} s; pool {pw['pool_reserved_mib']:.0f} MiB reserved, static buffers "
             f"{pw['static_buffers_mib']:.0f} MiB; engine start {payload['startup_s']:.1f} s.\n"]
    if "memory" in payload:
        m = payload["memory"]
        lines.append(f"Engine device memory {m['device_used_by_engine_mib']:.0f} MiB, {m['kv_blocks']} KV blocks.\n")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--mixed", default="127x420", help="DECODESxCHUNK: decodes plus one fresh prompt chunk")
    p.add_argument("--prefill", type=int, default=480, help="tokens of the short prefill step")
    p.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens; also the long prefill step")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--burst", type=int, default=5)
    p.add_argument("--token-counts", default=None, help="comma-separated buckets (default: the engine's)")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=RESULTS_DIR)
    args = p.parse_args(argv)
    payload = {"schema": SCHEMA, "environment": environment(1, args.device == "cuda"),
               "command": " ".join(["python", "bench/piecewise_steps.py"] + list(argv if argv is not None else sys.argv[1:])),
               "config": vars(args).copy()}
    measure(args, payload)
    publish(args.out, f"piecewise-steps-{args.model}-tp1" + (f"-{args.tag}" if args.tag else ""), payload,
            markdown(payload))


if __name__ == "__main__":
    main()
