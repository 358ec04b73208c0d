"""Decode row-parallel layers (o_proj, down) at TP=W, bf16, M = 1..128 rows, µs per layer on this
rank, in CUDA graphs and eager, every kernel warm on every rank before timing:

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
trip (bench/notes/allreduce.md). The rows feed the dispatch table's GEMM + all-reduce rows
(rules.gemm_all_reduce_rows). On the CPU (interpreter) only eager, by wall clock: a smoke run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_overlap_plugin.ops.all_reduce import HeapAllReduce
from tp_overlap_plugin.ops.all_reduce_norm import HeapAllReduceNorm
from tp_overlap_plugin.gemm_config import gemm_all_reduce_config
from tp_overlap_plugin.kernels import layer_ops
from tp_overlap_plugin.ops.gemm_ar import GemmAllReduce
from tp_overlap_plugin.tuning.checks import agreed, check_close
from tp_overlap_plugin.tuning.results import md_table
from tp_overlap_plugin.tuning.timing import cycle, record, repeats_us

ROWS = (1, 8, 16, 32, 64, 128)  # decode step sizes the GEMM + all-reduce rows are measured at
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


def heap_bytes(world: int, shapes, rows) -> int:
    """Heap space `measure` needs per rank for these (name, k, n) and row counts."""
    max_rows, widths = max(rows), sorted({n for _, _, n in shapes})
    heap = sum(GemmAllReduce.heap_bytes(world, max_rows, n, torch.bfloat16)
               + HeapAllReduceNorm.heap_bytes(world, n, max_rows, torch.bfloat16) for n in widths)
    return heap + HeapAllReduce.heap_bytes(world, max_rows * max(widths) * 2) + (4 << 20)


def measure(ctx, shapes, rows, repeats: int = 1, samples: int = 10, on_row=None) -> list[dict]:
    """Every op above per (name, k, n) of `shapes` (k: this rank's share) and M in `rows`, checked
    against the stock path first, then timed in interleaved repeats (timing.record's keys)."""
    h, W, dev = ctx.heap, ctx.world_size, ctx.device
    gpu = dev.type == "cuda"
    max_rows, widths = max(rows), sorted({n for _, _, n in shapes})
    gemm_ar = {n: GemmAllReduce(h, max_rows, n, torch.bfloat16) for n in widths}
    fused = {n: HeapAllReduceNorm(h, n, max_rows, torch.bfloat16) for n in widths}
    comm = HeapAllReduce(h, max_bytes=max_rows * max(widths) * 2)
    out = []
    for name, k, n in shapes:
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
            ref_normed, _ = layer_ops.rmsnorm(ref, norm_w, EPS, residual)
            got_normed, _ = layer_ops.rmsnorm(got, norm_w, EPS, residual)
            # against the stock path, in ulps of bf16 (NCCL sums in its own order; the stock path rounds
            # each rank's product before it: checks.py)
            x_ulps = W + 2
            row.update(agreed(ctx, lambda: {
                **check_close("gemm_ar_vs_nccl", got, ref, W, extra_ulps=x_ulps),
                **check_close("normed_vs_nccl", got_normed, ref_normed, W, extra_ulps=x_ulps)}))
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
            record(row, repeats_us(ops, gpu=gpu, graph=False, repeats=repeats, calls=20 if gpu else 2,
                                   samples=samples, group=ctx.group), "eager")
            if gpu:
                errors: dict = {}
                record(row, repeats_us(ops, gpu=True, graph=True, repeats=repeats, calls=20, samples=samples,
                                       group=ctx.group, errors=errors), "graph")
                row.update({f"{name}_graph_error": e for name, e in errors.items()})
            out.append(row)
            if on_row is not None:
                on_row(row)
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
