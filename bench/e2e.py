"""End-to-end tokens/s, stock vs `--tp-overlap`, side by side in one run (issue: "Turn it on").

    python bench/e2e.py --model llama-3-8b --tp 2                 # H200x2: the issue's scenarios
    python bench/e2e.py --model demo --device cpu --quick         # a logic check on the CPU

Scenarios: prefill-heavy (2048-token prompts, 16 output tokens, batch 8 and 32) and decode-heavy
(128 in / 512 out at batch 1, 16, 64, 256). For each: output tokens/s, TTFT and TPOT with the flag
off and on; JSON + markdown + PNG in bench/results/.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, md_table, write_results  # noqa: E402

PREFILL = [(8, 2048, 16), (32, 2048, 16)]
DECODE = [(1, 128, 512), (16, 128, 512), (64, 128, 512), (256, 128, 512)]
QUICK = [(2, 24, 4), (4, 8, 8)]


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dispatch", default="table", choices=["table", "overlap"],
                   help="overlap: force our kernels everywhere (to see them), table: what users get")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from tp_overlap_plugin.serving import LLM, EngineConfig
    from tp_overlap_plugin.serving.bench_offline import scenario

    scenarios = QUICK if args.quick else PREFILL + DECODE
    max_batch = max(b for b, _, _ in scenarios)
    max_len = max(i + o for _, i, o in scenarios)
    base = dict(model=args.model, tensor_parallel_size=args.tp, device=args.device, show_progress=False,
                max_num_seqs=max_batch, max_model_len=max_len + 16,
                max_num_batched_tokens=max(2048, max_batch) if not args.quick else 64,
                load_format="dummy" if args.model != "demo" else "auto")
    if args.device == "cpu":
        base.update(dtype="bfloat16", kv_cache_bytes=64 << 20)
    results = {}
    for flag in ("stock", "overlap"):
        cfg = EngineConfig(**base, tp_overlap={"dispatch": args.dispatch} if flag == "overlap" else None)
        with LLM(cfg) as llm:
            results[flag] = [scenario(llm, b, i, o) for b, i, o in scenarios]
    env = environment(args.tp, on_gpu=args.device != "cpu", model=args.model, dispatch=args.dispatch,
                      quick=args.quick)
    rows = []
    for s, o in zip(results["stock"], results["overlap"]):
        rows.append([f"b{s['batch']} in{s['input_len']} out{s['output_len']}", s["output_tokens_per_s"],
                     o["output_tokens_per_s"], o["output_tokens_per_s"] / s["output_tokens_per_s"],
                     s["ttft_ms"].get("median", float("nan")), o["ttft_ms"].get("median", float("nan")),
                     s["tpot_ms"].get("median", float("nan")), o["tpot_ms"].get("median", float("nan"))])
    md = md_table(["scenario", "stock tok/s", "overlap tok/s", "overlap/stock", "TTFT stock ms", "TTFT overlap ms",
                   "TPOT stock ms", "TPOT overlap ms"], rows)
    paths = write_results(args.out, f"e2e-{args.model}-tp{args.tp}", {"environment": env, **results}, md)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], 0.4, label="stock")
        ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], 0.4, label="tp-overlap")
        ax.set_xticks(list(xs), [r[0] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("output tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(paths[0].replace(".json", ".png"), dpi=120)
    except ImportError:
        pass
    print(md)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
