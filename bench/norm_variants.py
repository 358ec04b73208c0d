"""The fused all-reduce + norm at several warp counts against our all-reduce alone (issue 15's target:
fused <= alone + 1 us), in CUDA graphs, every rank at once, the variants timed in interleaved rounds
so that drift on a shared machine hits them alike; the median round per variant:

    python bench/norm_variants.py --tp 2 [--warps 8 16 32] [--hidden 4096 8192] [--out bench/results]

bench/foundation.py times the shipped kernel beside the other paths; this is for tuning it.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, capture_graph, environment, interleaved_ms, md_table, publish  # noqa: E402

from tp_overlap_plugin.collectives import HeapAllReduce, HeapAllReduceNorm  # noqa: E402
from tp_overlap_plugin.kernels import layer_ops  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402

TOKENS = [1, 8, 32, 128, 256]
ROUNDS = 4
CALLS = 20
EPS = 1e-5


def _rank(ctx, hiddens, warps):
    h, dev = ctx.heap, ctx.device
    rows = []
    for H in hiddens:
        fused = {w: HeapAllReduceNorm(h, H, max(TOKENS), torch.bfloat16) for w in warps}
        for w, f in fused.items():
            f.num_warps = w
        comm = HeapAllReduce(h, max_bytes=max(TOKENS) * H * 2)
        weight = (1 + 0.1 * torch.randn(H, device=dev)).to(torch.bfloat16)
        for t in TOKENS:
            x = torch.randn(t, H, dtype=torch.bfloat16, device=dev)
            residual = torch.randn(t, H, dtype=torch.bfloat16, device=dev)
            dist.broadcast(residual, 0, group=ctx.device_group)
            reduced = x.clone()
            dist.all_reduce(reduced, group=ctx.device_group)
            ref_out, ref_res = layer_ops.rmsnorm(reduced, weight, EPS, residual)
            y = torch.empty_like(x)
            ops = {"ours_alone": lambda: comm(x, out=y)}
            for w, f in fused.items():
                got_out, got_res = f(x, residual, weight, EPS)
                assert (got_out.float() - ref_out.float()).abs().max() < 0.1
                assert (got_res.float() - ref_res.float()).abs().max() < 0.1
                ops[f"fused_w{w}"] = (lambda f=f: f(x, residual, weight, EPS))
            replays = {}
            for name, op in ops.items():
                op()
                torch.cuda.synchronize()
                replays[name] = capture_graph(op, CALLS)
                replays[name]()
            torch.cuda.synchronize()
            ms = interleaved_ms(replays, calls=CALLS, rounds=ROUNDS, samples=10, group=ctx.group)
            rows.append({"hidden": H, "tokens": t, **{f"{name}_us": 1e3 * v for name, v in ms.items()}})
    h.check()
    return rows


def main():
    p = bench_parser(__doc__)
    p.add_argument("--warps", type=int, nargs="+", default=[16])
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--name", default="", help="suffix of the result's name")
    args = p.parse_args()
    per_rank = run_ranks(_rank, args.tp, (args.hidden, args.warps), device="cuda", heap_size=256 << 20, timeout=500)
    rows = per_rank[0]
    md = md_table(["hidden", "T", "alone µs", *[f"fused w{w} − alone µs" for w in args.warps]],
                  [[r["hidden"], r["tokens"], r["ours_alone_us"],
                    *[r[f"fused_w{w}_us"] - r["ours_alone_us"] for w in args.warps]] for r in rows])
    publish(args.out, f"norm-variants-tp{args.tp}" + (f"-{args.name}" if args.name else ""),
            {"environment": environment(args.tp), "warps": args.warps, "rows": rows, "per_rank": per_rank}, md)


if __name__ == "__main__":
    main()
