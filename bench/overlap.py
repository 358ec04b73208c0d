"""AG-GEMM / GEMM-RS / all-reduce benchmark on GPUs, one command, every kernel warm on every rank:

    python bench/overlap.py --tp 2 [--out bench/results] [--quick]

Per Llama TP shape: cuBLAS GEMM alone, NCCL comm alone, sequential (NCCL + cuBLAS), torch
symmetric-memory fused op, our Triton GEMM alone, ours overlapped; ratios vs sequential and vs the
floor max(cuBLAS, NCCL). Then an M sweep on the 8B shapes (the dispatch table) and the all-reduce
sweep 8 KB-64 MB (one-shot, two-shot, NCCL, torch; eager and in a
CUDA graph). B is the transpose of an nn.Linear weight, as the TP layers pass it. Times are the
max over ranks of each rank's median.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (bench_parser, environment, graph_time_per_call_ms, grouped_bars, md_table,  # noqa: E402
                      time_per_call_ms, write_results)

from tp_overlap_plugin.collectives import HeapAllReduce  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402
from tp_overlap_plugin.overlap import AllGatherGemm, GemmReduceScatter, gemm  # noqa: E402

# (model, layer, op, K, N) for TP=W: column-parallel N and row-parallel K are divided by W.
LLAMA = {
    "8B": dict(hidden=4096, inter=14336, q=4096, kv=1024),
    "70B": dict(hidden=8192, inter=28672, q=8192, kv=1024),
}


def llama_shapes(world: int):
    out = []
    for name, d in LLAMA.items():
        out += [(name, "qkv", "ag", d["hidden"], (d["q"] + 2 * d["kv"]) // world),
                (name, "o_proj", "rs", d["q"] // world, d["hidden"]),
                (name, "gate_up", "ag", d["hidden"], 2 * d["inter"] // world),
                (name, "down", "rs", d["inter"] // world, d["hidden"])]
    return out


AR_SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20, 64 << 20]


def _torch_fused(ctx):
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
        return ctx.device_group.group_name
    except Exception:
        return None


def weight_t(n, k, dev, gen):
    """B as the TP layers pass it: the transpose of an nn.Linear weight [N, K], a view (no copy)."""
    return (torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) / k ** 0.5).t()


def _measure_shape(ctx, op, m, k, n, gname, results, key, calls, torch_fused=False):
    """Times every variant of one (op, M, K, N) on this rank; fills results[key]. torch's fused ops
    run in a separate pass (torch_fused=True) so that a failure there cannot cost our numbers."""
    W, dev, h = ctx.world_size, ctx.device, ctx.heap
    rows = m // W
    gen = torch.Generator(device=dev).manual_seed(1234 + ctx.rank)
    row = results.setdefault(key, {"op": op, "M": m, "K": k, "N": n})
    t0 = time.perf_counter()
    if ctx.rank == 0:
        print(f"[bench] {key} {'torch_fused' if torch_fused else ''}", file=sys.stderr, flush=True)
    with h.scope():
        if op == "ag":
            a_shard = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
            b = weight_t(n, k, dev, gen)
            a_full = torch.empty(m, k, device=dev, dtype=torch.bfloat16)
            fused = AllGatherGemm(h, rows, k)
            variants = {
                "cublas": lambda: torch.matmul(a_full, b),
                "nccl": lambda: dist.all_gather_into_tensor(a_full, a_shard, group=ctx.device_group),
                "sequential": lambda: (dist.all_gather_into_tensor(a_full, a_shard, group=ctx.device_group),
                                       torch.matmul(a_full, b)),
                "triton_gemm": lambda: gemm(a_full, b),
                "ours": lambda: fused(a_shard, b),
            }
            if gname and torch_fused:
                variants = {"torch_fused": lambda: torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], 0, gname)}
            dist.all_gather_into_tensor(a_full, a_shard, group=ctx.device_group)
            ref = torch.matmul(a_full, b).float()
        else:
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            b = weight_t(n, k, dev, gen)
            full = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            shard = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            fused = GemmReduceScatter(h, rows, n)
            variants = {
                "cublas": lambda: torch.matmul(a, b, out=full),
                "nccl": lambda: dist.reduce_scatter_tensor(shard, full, group=ctx.device_group),
                "sequential": lambda: (torch.matmul(a, b, out=full),
                                       dist.reduce_scatter_tensor(shard, full, group=ctx.device_group)),
                "triton_gemm": lambda: gemm(a, b),
                "ours": lambda: fused(a, b),
            }
            if gname and torch_fused:
                variants = {"torch_fused": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, gname)}
            ref = torch.matmul(a, b).float()
            dist.all_reduce(ref, group=ctx.device_group)
            ref = ref[ctx.rank * rows:(ctx.rank + 1) * rows]
        if "ours" in variants:
            got = variants["ours"]().float()
            torch.cuda.synchronize()
            row["ours_rel_err"] = ((got - ref).norm() / ref.norm()).item()
        timed = list(variants.items())
        if "ours" in variants:
            # the fused ops are capturable: the same calls replayed from a CUDA graph, beside
            # sequential's, show what is left once the host's launch cost is gone
            timed += [("ours_graph", variants["ours"]), ("sequential_graph", variants["sequential"])]
        for name, fn in timed:
            try:
                t1 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                timer = graph_time_per_call_ms if name.endswith("_graph") else time_per_call_ms
                row[name] = timer(fn, calls=calls, samples=7, group=ctx.group)
                if ctx.rank == 0:
                    print(f"    {name}: first call {t2 - t1:.1f} s, timing {time.perf_counter() - t2:.1f} s, "
                          f"{row[name]:.3f} ms", file=sys.stderr, flush=True)
            except Exception as e:
                row[name + "_error"] = repr(e)[:300]
        torch.cuda.synchronize()
        h.check()
        dist.barrier(group=ctx.group)  # no peer kernel may still touch this scope's heap space
    row["bench_seconds"] = time.perf_counter() - t0


def _bench_rank(ctx, quick, partial, skip=()):
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    gname = _torch_fused(ctx)
    W = ctx.world_size
    out = {"shapes": {}, "sweep": {}, "all_reduce": [], "errors": []}
    ms = [8192] if quick else [2048, 8192]
    sweep_ms = [W, 64, 512, 2048] if quick else [W, 16, 64, 256, 1024, 4096, 16384]
    shapes = [(f"{model}/{layer}/{m}", op, m, k, n) for model, layer, op, k, n in llama_shapes(W) for m in ms
              if not quick or layer in ("gate_up", "down") or model == "8B"]
    sweep = [(f"{layer}/{m}", op, m, k, n) for model, layer, op, k, n in llama_shapes(W) if model == "8B"
             for m in sweep_ms if not quick or layer in ("gate_up", "down")]
    def checkpoint():
        # rank 0's numbers so far, in case the run is cut off
        if ctx.rank == 0:
            with open(partial, "w") as f:
                json.dump(out, f)

    def phase_shapes(torch_fused):
        for key, op, m, k, n in shapes:
            _measure_shape(ctx, op, m, k, n, gname, out["shapes"], key, 5, torch_fused)
            checkpoint()
        for key, op, m, k, n in sweep:
            _measure_shape(ctx, op, m, k, n, gname, out["sweep"], key, 10 if m <= 1024 else 5, torch_fused)
            checkpoint()

    def phase_all_reduce():
        out["all_reduce"] = _all_reduce_sweep(ctx, gname, AR_SIZES[:6] if quick else AR_SIZES)
        checkpoint()

    # A CUDA error is sticky: after the first failed phase, return what was measured.
    phases = [("shapes", lambda: phase_shapes(False)), ("all_reduce", phase_all_reduce),
              ("torch_fused", lambda: phase_shapes(True))]
    for name, phase in phases:
        if name in skip:
            continue
        try:
            phase()
        except Exception:
            out["errors"].append(f"phase {name}: {traceback.format_exc()[-1500:]}")
            break
    return out


def _all_reduce_sweep(ctx, gname, sizes):
    h = ctx.heap
    rows = []
    with h.scope():
        # one-shot up to 8 MB (its receive slots take 2 * W times its capacity), two-shot everywhere
        comm = HeapAllReduce(h, max_bytes=max(sizes), one_shot_max_bytes=min(max(sizes), 8 << 20))
        symm = None
        if gname:
            import torch.distributed._symmetric_memory as symm_mem
            symm = symm_mem.empty(max(sizes) // 2, dtype=torch.bfloat16, device=ctx.device)
            symm_mem.rendezvous(symm, gname)
        for nbytes in sizes:
            x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=ctx.device)
            y = torch.empty_like(x)
            nccl_buf = x.clone()
            ref = x.float()
            dist.all_reduce(ref, group=ctx.device_group)
            row = {"bytes": nbytes}
            ops = {"one_shot": lambda: comm(x, out=y, algorithm="one_shot"),
                   "two_shot": lambda: comm(x, out=y, algorithm="two_shot"),
                   "nccl": lambda: dist.all_reduce(nccl_buf, group=ctx.device_group)}
            if symm is not None:
                inp = symm[: x.numel()]
                inp.copy_(x)
                ops["torch_one_shot"] = lambda: torch.ops.symm_mem.one_shot_all_reduce(inp, "sum", gname)
                ops["torch_two_shot"] = lambda: torch.ops.symm_mem.two_shot_all_reduce_(inp, "sum", gname)
            if nbytes > comm.one_shot_bytes:
                row["one_shot_error"] = f"over one_shot_max_bytes={comm.one_shot_bytes}"
                del ops["one_shot"]
            for alg in ("one_shot", "two_shot"):
                if alg not in ops:
                    continue
                y.fill_(float("nan"))
                ops[alg]()
                torch.cuda.synchronize()
                row[f"{alg}_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
            for name, op in ops.items():
                try:
                    op()
                    torch.cuda.synchronize()
                    row[f"{name}_eager_us"] = 1e3 * time_per_call_ms(op, calls=20, samples=9, group=ctx.group)
                    row[f"{name}_graph_us"] = 1e3 * graph_time_per_call_ms(op, calls=20, samples=9, group=ctx.group)
                except Exception as e:
                    row[f"{name}_error"] = repr(e)[:200]
            rows.append(row)
        h.check()
    return rows


def _combine(per_rank):
    """Max over ranks of each timing (the op ends when the slowest rank ends)."""
    def merge(rows):
        out = dict(rows[0])
        for key, v in out.items():
            if isinstance(v, float) and not key.endswith("rel_err"):
                out[key] = max(r.get(key, v) for r in rows)
        return out
    r0 = per_rank[0]
    def common(section):
        return [k for k in r0[section] if all(k in r[section] for r in per_rank)]

    def common_list(section):
        return range(min(len(r[section]) for r in per_rank))
    res = {"shapes": {k: merge([r["shapes"][k] for r in per_rank]) for k in common("shapes")},
           "sweep": {k: merge([r["sweep"][k] for r in per_rank]) for k in common("sweep")},
           "all_reduce": [merge([r["all_reduce"][i] for r in per_rank]) for i in common_list("all_reduce")],
           "errors": sum((r["errors"] for r in per_rank), [])}
    for row in list(res["shapes"].values()) + list(res["sweep"].values()):
        if all(isinstance(row.get(k), float) for k in ("cublas", "nccl", "sequential")):
            row["floor"] = max(row["cublas"], row["nccl"])
            if isinstance(row.get("ours"), float):
                row["ours_vs_sequential"] = row["sequential"] / row["ours"]
                row["ours_vs_floor"] = row["ours"] / row["floor"]
                row["comm_hidden"] = max(0.0, min(1.0, (row["sequential"] - row["ours"]) / row["nccl"]))
        if isinstance(row.get("ours_graph"), float) and isinstance(row.get("sequential_graph"), float):
            row["graph_seq_vs_ours"] = row["sequential_graph"] / row["ours_graph"]
    return res


def _markdown(res):
    md = "## Llama TP shapes (ms)\n\n"
    hdr = ["shape", "op", "M", "K", "N", "cuBLAS", "NCCL", "sequential", "torch fused", "our GEMM", "ours",
           "floor", "seq/ours", "ours/floor", "comm hidden", "GEMM ours/cuBLAS", "seq graph", "ours graph",
           "seq/ours graph"]
    rows = []
    for key, r in res["shapes"].items():
        rows.append([key, r["op"], r["M"], r["K"], r["N"], r.get("cublas", float("nan")), r.get("nccl", float("nan")),
                     r.get("sequential", float("nan")), r.get("torch_fused", float("nan")),
                     r.get("triton_gemm", float("nan")), r.get("ours", float("nan")), r.get("floor", float("nan")),
                     r.get("ours_vs_sequential", float("nan")), r.get("ours_vs_floor", float("nan")),
                     r.get("comm_hidden", float("nan")), r.get("triton_gemm", float("nan")) / r.get("cublas", float("nan")),
                     r.get("sequential_graph", float("nan")), r.get("ours_graph", float("nan")),
                     r.get("graph_seq_vs_ours", float("nan")),
                     ])
    md += md_table(hdr, rows)
    md += "\n## M sweep, Llama-3-8B shapes (ms): the dispatch table\n\n"
    rows = [[k, r.get("sequential", float("nan")), r.get("torch_fused", float("nan")), r.get("ours", float("nan")),
             r.get("ours_vs_sequential", float("nan")), "overlap" if r.get("ours_vs_sequential", 0) > 1.0 else "stock",
             r.get("sequential_graph", float("nan")), r.get("ours_graph", float("nan")),
             r.get("graph_seq_vs_ours", float("nan"))]
            for k, r in res["sweep"].items()]
    md += md_table(["layer/M", "sequential", "torch fused", "ours", "seq/ours", "winner (eager)", "seq graph",
                    "ours graph", "seq/ours graph"], rows)
    md += "\n## All-reduce, bf16, µs per op (CUDA graph | eager)\n\n"
    names = ["one_shot", "two_shot", "nccl", "torch_one_shot", "torch_two_shot"]
    rows = []
    for r in res["all_reduce"]:
        best = min(r.get("one_shot_graph_us", 1e9), r.get("two_shot_graph_us", 1e9))
        rows.append([f"{r['bytes'] >> 10} KB", *[r.get(f"{n}_graph_us", float("nan")) for n in names],
                     best / r.get("nccl_graph_us", float("nan")),
                     *[r.get(f"{n}_eager_us", float("nan")) for n in names]])
    md += md_table(["size", *[f"graph {n}" for n in names], "best ours/NCCL (graph)", *[f"eager {n}" for n in names]], rows)
    if res["errors"]:
        md += "\n## Errors\n\n" + "\n".join(f"- {e.splitlines()[-1]}" for e in res["errors"]) + "\n"
    return md


def _plot(res, path):
    keys = list(res["shapes"])
    series = {name: [res["shapes"][k].get(name, 0) / res["shapes"][k].get("sequential", 1) for k in keys]
              for name in ("sequential", "torch_fused", "ours", "floor")}
    return grouped_bars(path, keys, series, "time / sequential (lower is better)", rotation=60)


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--timeout", type=float, default=590)
    p.add_argument("--skip", default="", help="comma-separated phases to leave out: all_reduce, torch_fused")
    args = p.parse_args(argv)
    partial = os.path.join(args.out, "overlap-partial-rank0.json")
    try:
        per_rank = run_ranks(_bench_rank, args.tp, (args.quick, partial, tuple(args.skip.split(","))), device="cuda", heap_size=1400 << 20,
                             timeout=args.timeout)
    except Exception as e:  # cut off: report rank 0's numbers so far, and say so
        with open(partial) as f:
            per_rank = [json.load(f)]
        per_rank[0]["errors"].append(f"run cut off, rank 0 only: {str(e)[-300:]}")
    res = _combine(per_rank)
    md = _markdown(res)
    paths = write_results(args.out, f"overlap-tp{args.tp}", {"environment": environment(args.tp), **res}, md)
    png = _plot(res, paths[0].replace(".json", ".png"))
    print(md)
    print("wrote", *paths, png or "")


if __name__ == "__main__":
    main()
