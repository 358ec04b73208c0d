"""End-to-end tokens/s, stock vs `--tp-overlap`, side by side in one run (issue: "Turn it on").

    python bench/e2e.py --model llama-3-8b --tp 2                 # H200x2: the issue's scenarios
    python bench/e2e.py --model llama-3-8b --tp 1                 # the engine alone (stock only)
    python bench/e2e.py --model demo --device cpu --quick         # a logic check on the CPU

Scenarios: prefill-heavy (2048-token prompts, 16 output tokens, batch 8 and 32) and decode-heavy
(128 in / 512 out at batch 1, 16, 64, 256). For each: output tokens/s, TTFT and TPOT with the flag
off and on (at TP=1 there is nothing to overlap: stock only). The batch-1 decode step is compared
with its floor, reading each rank's weights once from HBM at the bandwidth of a device copy
measured in the same run. JSON + markdown + PNG in bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, grouped_bars, md_table, write_results  # noqa: E402

PREFILL = [(8, 2048, 16), (32, 2048, 16)]
DECODE = [(1, 128, 512), (16, 128, 512), (64, 128, 512), (256, 128, 512)]
QUICK = [(2, 24, 4), (4, 8, 8)]


def hbm_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written: what a decode step that
    streams the weights once can hope for."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dispatch", default="table", choices=["table", "overlap"],
                   help="overlap: force our kernels everywhere (to see them), table: what users get")
    p.add_argument("--only", choices=["prefill", "decode"], help="one family of scenarios")
    p.add_argument("--order", default="stock,overlap",
                   help="which engine runs first (to check that run order does not bias the ratio)")
    p.add_argument("--variant", choices=["stock", "overlap"], help=argparse.SUPPRESS)
    p.add_argument("--variant-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from tp_overlap_plugin.serving import LLM, EngineConfig
    from tp_overlap_plugin.serving.bench_offline import scenario

    scenarios = QUICK if args.quick else {"prefill": PREFILL, "decode": DECODE}.get(args.only, PREFILL + DECODE)
    max_batch = max(b for b, _, _ in scenarios)
    max_len = max(i + o for _, i, o in scenarios)
    base = dict(model=args.model, tensor_parallel_size=args.tp, device=args.device, show_progress=False,
                max_num_seqs=max_batch, max_model_len=max_len + 16,
                # vLLM's offline default: prefill steps of up to 8192 tokens (4 of the 2048-token prompts)
                max_num_batched_tokens=8192 if not args.quick else 64,
                load_format="dummy" if args.model != "demo" else "auto")
    if args.device == "cpu":
        base.update(dtype="bfloat16", kv_cache_bytes=64 << 20)
    if args.variant:  # one engine in this process (the parent runs each variant in a fresh one)
        cfg = EngineConfig(**base, tp_overlap={"dispatch": args.dispatch} if args.variant == "overlap" else None)
        with LLM(cfg) as llm:
            weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
            # distinct prompts per scenario: the prefix cache must not turn one scenario's prefill into hits
            res = [scenario(llm, b, i, o, seed=1000 * b + i) for b, i, o in scenarios]
        with open(args.variant_out, "w") as f:
            json.dump({"results": res, "weight_bytes": weight_bytes}, f)
        return
    results = {}
    flags = ("stock",) if args.tp == 1 else tuple(args.order.split(","))
    if args.tp > 1 and sorted(flags) != ["overlap", "stock"]:
        raise SystemExit(f"--order must name stock and overlap once each, got {args.order!r}")
    with tempfile.TemporaryDirectory() as tmp:
        for flag in flags:
            # a fresh process per engine: nothing of the first (CUDA context, process group, heap)
            # can leak into the second's numbers
            out = os.path.join(tmp, f"{flag}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                            "--variant", flag, "--variant-out", out], check=True)
            with open(out) as f:
                got = json.load(f)
            results[flag], weight_bytes = got["results"], got["weight_bytes"]
    env = environment(args.tp, on_gpu=args.device != "cpu", model=args.model, dispatch=args.dispatch,
                      quick=args.quick, order=list(flags), weight_bytes_per_rank=weight_bytes)
    floor_md = ""
    if args.device != "cpu":
        bw = hbm_copy_bandwidth()
        floor_ms = weight_bytes / bw * 1e3
        env.update(hbm_copy_bytes_per_s=bw, decode_floor_ms=floor_ms)
        b1 = [s for s in results["stock"] if s["batch"] == 1]
        if b1:
            step = b1[0]["tpot_ms"]["median"]
            floor_md = (f"\nBatch-1 decode step (stock, median TPOT): {step:.2f} ms; floor {floor_ms:.2f} ms "
                        f"({weight_bytes / 1e9:.2f} GB of weights per rank at {bw / 1e12:.2f} TB/s, a device copy "
                        f"measured in this run): **{step / floor_ms:.2f}x the floor**.\n")
    rows = []
    for i, s in enumerate(results["stock"]):
        o = results["overlap"][i] if "overlap" in results else None
        row = [f"b{s['batch']} in{s['input_len']} out{s['output_len']}", s["output_tokens_per_s"],
               s["total_tokens_per_s"], s["ttft_ms"].get("median", float("nan")), s["tpot_ms"].get("median", float("nan"))]
        if o:
            row[2:2] = [o["output_tokens_per_s"], o["output_tokens_per_s"] / s["output_tokens_per_s"]]
            row += [o["ttft_ms"].get("median", float("nan")), o["tpot_ms"].get("median", float("nan"))]
        rows.append(row)
    headers = ["scenario", "stock out tok/s", "stock total tok/s", "TTFT stock ms", "TPOT stock ms"]
    if "overlap" in results:
        headers = ["scenario", "stock out tok/s", "overlap out tok/s", "overlap/stock", "stock total tok/s",
                   "TTFT stock ms", "TPOT stock ms", "TTFT overlap ms", "TPOT overlap ms"]
    md = md_table(headers, rows) + floor_md
    name = f"e2e-{args.model}-tp{args.tp}" + (f"-{args.only}" if args.only else "") + \
        ("-overlap-first" if flags[0] == "overlap" else "")
    paths = write_results(args.out, name, {"environment": env, **results}, md)
    series = {"stock": [r[1] for r in rows]}
    if "overlap" in results:
        series["tp-overlap"] = [r[2] for r in rows]
    grouped_bars(paths[0].replace(".json", ".png"), [r[0] for r in rows], series, "output tokens/s")
    print(md)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
