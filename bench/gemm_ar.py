"""Decode row-parallel layers (o_proj, down) at TP=W, bf16, M = 1..128 rows, µs per layer on rank 0,
in CUDA graphs and eager, every kernel warm on every rank before timing:

    linear             cuBLAS F.linear alone (no reduction: the GEMM's own floor)
    linear_nccl        F.linear + NCCL all-reduce (the stock path)
    linear_ours        F.linear + our all-reduce (HeapAllReduce, "auto")
    gemm_ar            our GEMM + all-reduce, one kernel (GemmAllReduce)
  and with the residual add + RMSNorm that follows these layers in the decoder:
    linear_nccl_norm   F.linear + NCCL + layer_ops.rmsnorm (the stock path)
    linear_fused_norm  F.linear + our fused all-reduce + add + norm (HeapAllReduceNorm)
    gemm_ar_norm       GemmAllReduce + layer_ops.rmsnorm

Each call reads another copy of the weight, so the copies together overflow L2 as a model's layers
do (a weight that stays in L2 between calls would read faster than any decode step sees). The
floor is max(weight bytes / HBM bandwidth, bytes pushed to peers / link bandwidth) + one one-way
trip (bench/notes/allreduce.md). Results feed bench/make_dispatch_table.py --gemm-ar.

    python bench/gemm_ar.py --tp 2 [--quick] [--out bench/results]
    python bench/gemm_ar.py --tp 2 --device cpu --quick    # smoke run: interpreter, tiny shapes, eager only
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (bench_parser, cycle, environment, graph_time_per_call_ms, md_table, publish,  # noqa: E402
                      time_per_call_ms)

from tp_overlap_plugin.collectives import HeapAllReduce, HeapAllReduceNorm  # noqa: E402
from tp_overlap_plugin.gemm_config import gemm_all_reduce_config  # noqa: E402
from tp_overlap_plugin.kernels import layer_ops  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402
from tp_overlap_plugin.overlap import GemmAllReduce  # noqa: E402

# (name, full K, N): the row-parallel layers of Llama-3 8B and 70B; each rank holds K / W
SHAPES = [("8B o_proj", 4096, 4096), ("8B down", 14336, 4096), ("70B o_proj", 8192, 8192),
          ("70B down", 28672, 8192)]
ROWS = [1, 8, 16, 32, 64, 128]
QUICK_SHAPES, QUICK_ROWS = SHAPES[:2], [1, 16, 64]
CPU_SHAPES, CPU_ROWS = [("tiny", 80, 48)], [1, 3]  # the smoke run: a few interpreter tiles
HBM_BYTES_PER_S = 4.28e12  # measured on H200 (bench/notes/allreduce.md)
LINK_BYTES_PER_S = 345e9   # Triton remote store, per GPU (DESIGN.md §9)
ONE_WAY_US = 0.7
L2_FLUSH_BYTES = 160 << 20  # weight copies per op: enough to overflow H200's 50 MB L2 three times
EPS = 1e-5
NORMED = ("linear_nccl_norm", "linear_fused_norm", "gemm_ar_norm")
PLAIN = ("linear", "linear_nccl", "linear_ours", "gemm_ar")


def floor_us(k: int, n: int, m: int, world: int) -> float:
    weight = n * k * 2
    pushed = (world - 1) * m * n * 2
    return 1e6 * max(weight / HBM_BYTES_PER_S, pushed / LINK_BYTES_PER_S) + ONE_WAY_US


def _wall_ms(fn, calls: int) -> float:
    """The CPU smoke run's timer: no device events there."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - t0) / calls


def _bench_rank(ctx, shapes, rows):
    h, W, dev = ctx.heap, ctx.world_size, ctx.device
    gpu = dev.type == "cuda"
    max_rows, widths = max(rows), sorted({n for _, _, n in shapes})
    gemm_ar = {n: GemmAllReduce(h, max_rows, n, torch.bfloat16) for n in widths}
    fused = {n: HeapAllReduceNorm(h, n, max_rows, torch.bfloat16) for n in widths}
    comm = HeapAllReduce(h, max_bytes=max_rows * max(widths) * 2)
    out = []
    for name, k_full, n in shapes:
        k = k_full // W
        copies = max(2, -(-L2_FLUSH_BYTES // (n * k * 2))) if gpu else 1
        gen = torch.Generator(device=dev).manual_seed(1000 + ctx.rank)
        weights = [(torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).to(torch.bfloat16)
                   for _ in range(copies)]
        norm_w = (1 + 0.1 * torch.randn(n, device=dev)).to(torch.bfloat16)
        dist.broadcast(norm_w, 0, group=ctx.device_group)
        for m in rows:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            residual = torch.randn(m, n, device=dev).to(torch.bfloat16)
            dist.broadcast(residual, 0, group=ctx.device_group)  # replicated, as in the decode layout
            row = {"shape": name, "K": k, "N": n, "M": m, "weight_copies": copies,
                   "weight_bytes": n * k * 2, "pushed_bytes": (W - 1) * m * n * 2, "floor_us": floor_us(k, n, m, W),
                   "gemm_ar_config": gemm_all_reduce_config(m, n, gemm_ar[n].programs, dev).label()}
            # correctness first, against the stock path (NCCL sums bf16 in its own order)
            ref = F.linear(x, weights[0])
            dist.all_reduce(ref, group=ctx.device_group)
            got = gemm_ar[n](x, weights[0])
            ref_normed, ref_res = layer_ops.rmsnorm(ref, norm_w, EPS, residual)
            got_normed, got_res = layer_ops.rmsnorm(got, norm_w, EPS, residual)
            row["rel_err_vs_nccl"] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            row["normed_max_err_vs_nccl"] = (got_normed.float() - ref_normed.float()).abs().max().item()
            assert row["rel_err_vs_nccl"] < 1e-2, row
            w_next = {op: cycle(weights) for op in PLAIN + NORMED}

            def linear_nccl(op):
                y = F.linear(x, w_next[op]())
                dist.all_reduce(y, group=ctx.device_group)
                return y
            ops = {
                "linear": lambda: F.linear(x, w_next["linear"]()),
                "linear_nccl": lambda: linear_nccl("linear_nccl"),
                "linear_ours": lambda: comm(F.linear(x, w_next["linear_ours"]())),
                "gemm_ar": lambda: gemm_ar[n](x, w_next["gemm_ar"]()),
                "linear_nccl_norm": lambda: layer_ops.rmsnorm(linear_nccl("linear_nccl_norm"), norm_w, EPS, residual),
                "linear_fused_norm": lambda: fused[n](F.linear(x, w_next["linear_fused_norm"]()), residual, norm_w, EPS),
                "gemm_ar_norm": lambda: layer_ops.rmsnorm(gemm_ar[n](x, w_next["gemm_ar_norm"]()), norm_w, EPS,
                                                          residual),
            }
            for op in ops.values():  # every kernel compiled and run on every rank before any timing
                op()
            if gpu:
                torch.cuda.synchronize()
            dist.barrier(group=ctx.group)
            for op_name, op in ops.items():
                if not gpu:
                    row[f"{op_name}_eager_us"] = 1e3 * _wall_ms(op, 2)
                    continue
                row[f"{op_name}_eager_us"] = 1e3 * time_per_call_ms(op, calls=20, samples=10, group=ctx.group)
                try:
                    row[f"{op_name}_graph_us"] = 1e3 * graph_time_per_call_ms(op, calls=20, samples=10,
                                                                             group=ctx.group)
                except Exception as e:  # keep the run going; the JSON says why
                    row[f"{op_name}_graph_error"] = repr(e)[:200]
            out.append(row)
    h.check()
    return out


def _get(r, op, mode):
    return r.get(f"{op}_{mode}_us", float("nan"))


def markdown(res: dict) -> str:
    mode = "graph" if res["environment"]["device"] != "cpu" else "eager"
    md = (f"## GEMM + all-reduce, decode row layers at TP={res['environment']['tp']}, bf16, µs per layer "
          f"({'CUDA graphs' if mode == 'graph' else 'eager, CPU interpreter: a smoke run, not a measurement'}, "
          f"rank 0)\n\nfloor = max(weight / {HBM_BYTES_PER_S / 1e12:.2f} TB/s, pushed / "
          f"{LINK_BYTES_PER_S / 1e9:.0f} GB/s) + {ONE_WAY_US} µs. `best stock` is the faster of linear_nccl and "
          f"linear_ours (what the dispatcher would otherwise run); with the norm, of linear_nccl_norm and "
          f"linear_fused_norm.\n\n")
    rows = []
    for r in res["rows"]:
        best = min(_get(r, "linear_nccl", mode), _get(r, "linear_ours", mode))
        best_norm = min(_get(r, "linear_nccl_norm", mode), _get(r, "linear_fused_norm", mode))
        rows.append([r["shape"], r["K"], r["N"], r["M"], r["floor_us"], *[_get(r, op, mode) for op in PLAIN],
                     _get(r, "gemm_ar", mode) / best, *[_get(r, op, mode) for op in NORMED],
                     _get(r, "gemm_ar_norm", mode) / best_norm, _get(r, "gemm_ar", mode) / r["floor_us"],
                     r["gemm_ar_config"]])
    md += md_table(["layer", "K", "N", "M", "floor", *PLAIN, "gemm_ar / best stock", *NORMED,
                    "gemm_ar_norm / best stock+norm", "gemm_ar / floor", "gemm_ar tiles"], rows)
    if mode == "graph":
        md += "\n## Eager (µs per layer; launch-bound in these VMs)\n\n"
        md += md_table(["layer", "M", *PLAIN, *NORMED],
                       [[r["shape"], r["M"], *[_get(r, op, "eager") for op in PLAIN + NORMED]] for r in res["rows"]])
    return md


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    shapes, rows = (QUICK_SHAPES, QUICK_ROWS) if args.quick else (SHAPES, ROWS)
    if not gpu:
        shapes, rows = CPU_SHAPES, CPU_ROWS
    max_rows, widths = max(rows), sorted({n for _, _, n in shapes})
    heap = sum(GemmAllReduce.heap_bytes(args.tp, max_rows, n, torch.bfloat16)
               + HeapAllReduceNorm.heap_bytes(args.tp, n, max_rows, torch.bfloat16) for n in widths)
    heap += HeapAllReduce.heap_bytes(args.tp, max_rows * max(widths) * 2) + (4 << 20)
    per_rank = run_ranks(_bench_rank, args.tp, (shapes, rows), device=args.device,
                         heap_size=-(-heap // 4096) * 4096, timeout=900 if gpu else 400)
    env = environment(args.tp, on_gpu=gpu)
    res = {"schema": "gemm-ar/1", "environment": env, "config": {"quick": args.quick, "shapes": shapes, "rows": rows,
           "hbm_bytes_per_s": HBM_BYTES_PER_S, "link_bytes_per_s": LINK_BYTES_PER_S, "one_way_us": ONE_WAY_US},
           "rows": per_rank[0], "all_ranks": per_rank}
    md = markdown(res)
    publish(args.out, f"gemm-ar-tp{args.tp}", res, md)


if __name__ == "__main__":
    main()
