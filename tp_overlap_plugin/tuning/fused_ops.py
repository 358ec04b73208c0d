"""AG-GEMM and GEMM-RS against the stock layout's pieces, per (op, M, K, N), on every rank of a
run_ranks() context with a heap: cuBLAS alone, the collective alone (NCCL/RCCL; gloo on the CPU),
sequential (the collective, then cuBLAS, or cuBLAS then the reduce-scatter), our GEMM core alone,
ours overlapped (checked against the sequential result first), the last two of those in CUDA
graphs, and torch's symmetric-memory fused ops in a pass of their own. B is the transpose of an
nn.Linear weight, as the TP layers pass it. Times are this rank's (the caller takes the max)."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from tp_overlap_plugin import runtime
from tp_overlap_plugin.ops.ag_gemm import AllGatherGemm
from tp_overlap_plugin.ops.chunked import ChunkedAllGatherGemm, ChunkedGemmReduceScatter
from tp_overlap_plugin.ops.gemm import gemm
from tp_overlap_plugin.ops.gemm_rs import GemmReduceScatter
from tp_overlap_plugin.tuning.checks import agreed, check_close
from tp_overlap_plugin.tuning.timing import repeats_us

ALL = ("cublas", "nccl", "sequential", "triton_gemm", "ours", "ours_graph", "sequential_graph", "chunked",
       "chunked_graph")
TABLE = ("sequential", "ours")  # what the dispatch table compares


def torch_fused_group(ctx) -> str | None:
    """The group name torch's fused symmetric-memory ops take, or None where they are not available."""
    if ctx.device.type != "cuda":
        return None
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
        return ctx.device_group.group_name
    except Exception:
        return None


def weight_t(n, k, dev, gen):
    """B as the TP layers pass it: the transpose of an nn.Linear weight [N, K], a view (no copy)."""
    return (torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) / k ** 0.5).t()


def measure_shape(ctx, op, m, k, n, gname, row: dict, calls, torch_fused=False, variants=ALL, repeats=1,
                  samples=7, log=True, design="kernel"):
    """Times the variants of one (op, M, K, N) on this rank into `row`. torch's fused ops run in a
    separate pass (torch_fused=True) so that a failure there cannot cost our numbers. With
    `repeats` > 1 the variants take turns, repeat by repeat, and each repeat's time is kept
    (`<variant>_repeats`), the median as `<variant>`. `design`: the op "ours" stands for (the
    table's): "kernel" (the one-launch fused op) or "chunked" (ops/chunked.py); `row["design"]`."""
    W, dev, h = ctx.world_size, ctx.device, ctx.heap
    gpu = dev.type == "cuda"
    rows = m // W
    gen = torch.Generator(device=dev).manual_seed(1234 + ctx.rank)
    row.update({"op": op, "M": m, "K": k, "N": n, "design": design, "graphs": gpu})
    t0 = time.perf_counter()
    if ctx.rank == 0 and log:
        print(f"[bench] {op} M={m} K={k} N={n} {'torch_fused' if torch_fused else ''}", file=sys.stderr, flush=True)
    # the chunked op where it is timed or is "ours"; never in torch's pass, which times torch's op alone
    chunked_too = ("chunked" in variants or design == "chunked") and not torch_fused
    with h.scope():
        if op == "ag":
            a_shard = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
            b = weight_t(n, k, dev, gen)
            a_full = torch.empty(m, k, device=dev, dtype=torch.bfloat16)
            fused, chunked = _ops(op, h, rows, k, design, chunked_too)
            gather = _collective(op, gpu, a_shard, a_full, ctx.device_group)
            fns = {
                "cublas": lambda: torch.matmul(a_full, b),
                "nccl": gather,
                "sequential": lambda: (gather(), torch.matmul(a_full, b)),
                "triton_gemm": lambda: gemm(a_full, b),
                "ours": lambda: fused(a_shard, b),
                "chunked": lambda: chunked(a_shard, b),
            }
            if gname and torch_fused:
                fns = {"torch_fused": lambda: torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], 0, gname)}
            gather()
            ref = torch.matmul(a_full, b).float()
        else:
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            b = weight_t(n, k, dev, gen)
            full = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            shard = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            fused, chunked = _ops(op, h, rows, n, design, chunked_too)
            scatter = _collective(op, gpu, full, shard, ctx.device_group)
            fns = {
                "cublas": lambda: torch.matmul(a, b, out=full),
                "nccl": scatter,
                "sequential": lambda: (torch.matmul(a, b, out=full), scatter()),
                "triton_gemm": lambda: gemm(a, b),
                "ours": lambda: fused(a, b),
                "chunked": lambda: chunked(a, b),
            }
            if gname and torch_fused:
                fns = {"torch_fused": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, gname)}
            ref = torch.matmul(a, b).float()
            dist.all_reduce(ref, group=ctx.device_group)
            ref = ref[ctx.rank * rows:(ctx.rank + 1) * rows]
        if not torch_fused:
            fns = {name: fn for name, fn in fns.items() if name in variants}
        for name in ("ours", "chunked"):
            if name in fns:
                got = fns[name]()
                if gpu:
                    torch.cuda.synchronize()
                # ulps of bf16 against the fp32 sequential result (checks.py); a wrong op is never timed
                figures = agreed(ctx, lambda: check_close(name, got, ref, W, torch.bfloat16))
                row[f"{name}_rel_err"], row[f"{name}_ulps"] = figures[f"{name}_rel_err"], figures[f"{name}_ulps"]
        timed = dict(fns)
        if gpu and "ours" in fns:
            # the fused ops are capturable: the same calls replayed from a CUDA graph, beside
            # sequential's, show what is left once the host's launch cost is gone
            timed.update({f"{name}_graph": fns[name] for name in ("ours", "sequential", "chunked")
                          if f"{name}_graph" in variants and name in fns})
        _time(ctx, timed, row, calls, repeats, samples, gpu, log)
        if gpu:
            torch.cuda.synchronize()
        h.check()
        dist.barrier(group=ctx.group)  # no peer kernel may still touch this scope's heap space
    row["bench_seconds"] = time.perf_counter() - t0


def _ops(op: str, h, rows: int, width: int, design: str, chunked_too: bool):
    """(what "ours" runs: the design's op, the chunked op or None): the AG-GEMM ("ag", `width` = K) or
    GEMM-RS ("rs", `width` = N) on the heap; the chunked one only with `chunked_too`."""
    one, chunk = (AllGatherGemm, ChunkedAllGatherGemm) if op == "ag" else (GemmReduceScatter, ChunkedGemmReduceScatter)
    chunked = chunk(h, rows, width) if chunked_too else None
    return (chunked if design == "chunked" else one(h, rows, width)), chunked


def _collective(op: str, gpu: bool, src, dst, group):
    """The stock collective of the op into `dst`: NCCL's all-gather ("ag") or reduce-scatter ("rs") on
    GPUs, runtime's on the CPU."""
    if gpu:
        nccl = dist.all_gather_into_tensor if op == "ag" else dist.reduce_scatter_tensor
        return lambda: nccl(dst, src, group=group)
    cpu = runtime.all_gather if op == "ag" else runtime.reduce_scatter
    return lambda: dst.copy_(cpu(src, group))


def _time(ctx, timed: dict, row: dict, calls: int, repeats: int, samples: int, gpu: bool, log: bool) -> None:
    """Warm each variant (a failure is the row's `<name>_error`), then time the eager ones and the
    graph ones, each group in interleaved repeats (ms per call)."""
    ok = {}
    for name, fn in timed.items():
        try:
            t1 = time.perf_counter()
            fn()
            if gpu:
                torch.cuda.synchronize()
            ok[name] = (fn, time.perf_counter() - t1)
        except Exception as e:
            row[name + "_error"] = repr(e)[:300]
    dist.barrier(group=ctx.group)
    for graph in (False, True):
        group = {name: fn for name, (fn, _) in ok.items() if name.endswith("_graph") == graph}
        if not group:
            continue
        errors: dict = {}
        t2 = time.perf_counter()
        times = repeats_us(group, gpu=gpu, graph=graph, repeats=repeats, calls=calls, samples=samples,
                           group=ctx.group, errors=errors)
        row.update({f"{name}_error": e for name, e in errors.items()})
        for name, ts in times.items():
            row[name] = statistics.median(ts) / 1e3
            if repeats > 1:
                row[f"{name}_repeats"] = [t / 1e3 for t in ts]
            if ctx.rank == 0 and log:
                print(f"    {name}: first call {ok[name][1]:.1f} s, timing {time.perf_counter() - t2:.1f} s, "
                      f"{row[name]:.3f} ms", file=sys.stderr, flush=True)
