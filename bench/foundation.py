"""Foundation microbenchmarks on GPUs (one command, every rank warm before timing):
  * remote load (pull) and store (push) bandwidth through the heap, all ranks at once;
  * device barrier latency, eager and inside a CUDA graph;
  * all-reduce 8 KB-8 MB, ours one-shot and two-shot vs NCCL and torch symmetric memory (one-shot,
    two-shot), eager and in a CUDA graph;
  * the decode row-layer epilogue at hidden 4096 and 8192, bf16, T = 1..256 tokens: our fused
    all-reduce + residual add + RMSNorm (one kernel) vs our all-reduce alone (issue 15's target:
    fused <= ours alone + 1 us) and vs ours, NCCL and torch symm-mem all-reduce each followed by
    the add + RMSNorm kernel (layer_ops.rmsnorm), eager and in a CUDA graph.

    python bench/foundation.py --tp 2 [--out bench/results] [--quick]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (bench_parser, environment, graph_time_per_call_ms, md_table, publish,  # noqa: E402
                      time_per_call_ms)
from remote_bw import copy_kernel  # noqa: E402

from tp_overlap_plugin.collectives import HeapAllReduce, HeapAllReduceNorm  # noqa: E402
from tp_overlap_plugin.kernels import layer_ops  # noqa: E402
from tp_overlap_plugin.kernels.barrier import launch_barrier  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402

COPY_BYTES = 256 << 20
AR_SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 4 << 20, 8 << 20]
NORM_HIDDEN = [4096, 8192]
NORM_TOKENS = [1, 8, 32, 128, 256]
EPS = 1e-5


def _bench_rank(ctx, quick):
    h, W = ctx.heap, ctx.world_size
    peer = (ctx.rank + 1) % W
    n = COPY_BYTES // 8
    heap_buf = h.alloc((n,), torch.int64, name="bench.copy").view(torch.float64)
    heap_buf.normal_()
    local = torch.empty_like(heap_buf)
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    out = {"copy": {}, "barrier": {}, "all_reduce": []}
    h.barrier()
    for mode, pull in (("remote_load", True), ("remote_store", False)):
        src, dst = (heap_buf, local) if pull else (local, heap_buf)

        def copy():
            copy_kernel[(sms * 4,)](src, dst, src, n, h.rank, peer, h.heap_bases, PULL=pull, FLAG=False,
                                    BLOCK=1024, num_warps=8)
        copy()
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        ms = time_per_call_ms(copy, calls=5, samples=10, group=ctx.group)
        out["copy"][mode] = {"bytes": COPY_BYTES, "ms": ms, "GBps": COPY_BYTES / ms / 1e6}
    # correctness of the pull: we loaded the peer's (random) buffer
    h.barrier()
    copy_kernel[(sms * 4,)](heap_buf, local, heap_buf, n, h.rank, peer, h.heap_bases, PULL=True, FLAG=False,
                            BLOCK=1024, num_warps=8)
    torch.cuda.synchronize()
    assert torch.equal(local, h.peer_view(heap_buf, peer)), "remote load returned wrong data"

    def barrier():
        launch_barrier(h, h._barrier_flags, h._barrier_epoch)
    barrier()
    out["barrier"]["eager_us"] = 1e3 * time_per_call_ms(barrier, calls=50, group=ctx.group)
    out["barrier"]["graph_us"] = 1e3 * graph_time_per_call_ms(barrier, calls=50, group=ctx.group)

    # one-shot measured at every size (its capacity raised to the largest); "auto" would take it up
    # to 1 MB and two-shot above
    comm = HeapAllReduce(h, max_bytes=max(AR_SIZES), one_shot_max_bytes=max(AR_SIZES))
    symm = _torch_symm_all_reduce(ctx, max(AR_SIZES))
    sizes = [AR_SIZES[0], AR_SIZES[3], AR_SIZES[5]] if quick else AR_SIZES
    for nbytes in sizes:
        numel = nbytes // 2
        x = torch.randn(numel, dtype=torch.bfloat16, device=ctx.device)
        y = torch.empty_like(x)
        nccl_buf = x.clone()
        ref = x.float().clone()
        dist.all_reduce(ref, group=ctx.device_group)
        row = {"bytes": nbytes}
        for alg in ("one_shot", "two_shot"):
            y.fill_(float("nan"))
            comm(x, out=y, algorithm=alg)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"{alg} all-reduce wrong at {nbytes} B: rel err {err}"
            row[f"{alg}_rel_err_vs_nccl_fp32"] = err
        ops = {"ours_one_shot": lambda: comm(x, out=y, algorithm="one_shot"),
               "ours_two_shot": lambda: comm(x, out=y, algorithm="two_shot"),
               "nccl": lambda: dist.all_reduce(nccl_buf, group=ctx.device_group)}
        if symm is not None:
            ops.update(symm(x))
        _time_ops(ops, row, ctx)
        out["all_reduce"].append(row)
    out["all_reduce_norm"] = [row for hidden in NORM_HIDDEN
                              for row in _norm_sweep(ctx, symm, hidden, NORM_TOKENS[:3] if quick else NORM_TOKENS)]
    h.check()
    return out


def _time_ops(ops, row, ctx):
    for name, op in ops.items():
        op()
        torch.cuda.synchronize()
        row[f"{name}_eager_us"] = 1e3 * time_per_call_ms(op, calls=20, group=ctx.group)
        try:
            row[f"{name}_graph_us"] = 1e3 * graph_time_per_call_ms(op, calls=20, group=ctx.group)
        except Exception as e:  # keep the run going; the JSON says why
            row[f"{name}_graph_error"] = repr(e)[:200]


def _norm_sweep(ctx, symm, H, tokens):
    """The row-layer epilogue of the decode layout, [T, H] bf16: all-reduce of the row layer's
    partial output, + residual, RMSNorm. Fused: one kernel; the others: an all-reduce, then
    layer_ops.rmsnorm (the add + norm kernel the model runs); `ours_alone`: the all-reduce alone."""
    h, dev = ctx.heap, ctx.device
    fused = HeapAllReduceNorm(h, H, max(tokens), torch.bfloat16)
    comm = HeapAllReduce(h, max_bytes=max(tokens) * H * 2)
    weight = (1 + 0.1 * torch.randn(H, device=dev)).to(torch.bfloat16)
    rows = []
    for t in tokens:
        x = torch.randn(t, H, dtype=torch.bfloat16, device=dev)
        residual = torch.randn(t, H, dtype=torch.bfloat16, device=ctx.device)
        dist.broadcast(residual, 0, group=ctx.device_group)  # replicated, as in the decode layout
        reduced = x.clone()
        dist.all_reduce(reduced, group=ctx.device_group)
        ref_out, ref_res = layer_ops.rmsnorm(reduced, weight, EPS, residual)
        got_out, got_res = fused(x, residual, weight, EPS)
        row = {"tokens": t, "hidden": H, "bytes": t * H * 2,
               "residual_max_err": (got_res.float() - ref_res.float()).abs().max().item(),
               "normed_max_err": (got_out.float() - ref_out.float()).abs().max().item()}
        # NCCL sums bf16 in its own order: an ulp or two of the inputs' size
        assert row["residual_max_err"] < 0.1 and row["normed_max_err"] < 0.1, row
        nccl_buf = x.clone()
        y = torch.empty_like(x)
        ops = {"fused": lambda: fused(x, residual, weight, EPS), "ours_alone": lambda: comm(x, out=y),
               "ours_then_norm": lambda: layer_ops.rmsnorm(comm(x, out=y), weight, EPS, residual),
               "nccl_then_norm": lambda: layer_ops.rmsnorm(_nccl(nccl_buf, ctx), weight, EPS, residual)}
        if symm is not None:
            symm_one_shot = symm(x.view(-1))["torch_symm_one_shot"]
            ops["torch_symm_then_norm"] = lambda: layer_ops.rmsnorm(symm_one_shot().view(t, H), weight, EPS, residual)
        _time_ops(ops, row, ctx)
        rows.append(row)
    return rows


def _nccl(buf, ctx):
    dist.all_reduce(buf, group=ctx.device_group)
    return buf


def _torch_symm_all_reduce(ctx, max_bytes):
    """torch's own symmetric-memory all-reduces (what vLLM uses on CUDA), or None if absent."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        group_name = ctx.device_group.group_name
        buf = symm_mem.empty(max_bytes // 2, dtype=torch.bfloat16, device=ctx.device)
        symm_mem.rendezvous(buf, group_name)
    except Exception as e:
        print(f"rank {ctx.rank}: torch symmetric memory unavailable: {e!r}", file=sys.stderr)
        return None

    def ops(x):
        inp = buf[: x.numel()]
        inp.copy_(x)
        return {"torch_symm_one_shot": lambda: torch.ops.symm_mem.one_shot_all_reduce(inp, "sum", group_name),
                "torch_symm_two_shot": lambda: torch.ops.symm_mem.two_shot_all_reduce_(inp, "sum", group_name)}
    return ops


def _markdown(res: dict) -> str:
    md = "## Remote access bandwidth (256 MB, all ranks at once, rank 0)\n\n"
    md += md_table(["op", "ms", "GB/s"], [[k, v["ms"], v["GBps"]] for k, v in res["copy"].items()])
    md += "\n## Device barrier (rank 0)\n\n"
    md += md_table(["eager µs", "CUDA graph µs"], [[res["barrier"]["eager_us"], res["barrier"]["graph_us"]]])
    md += "\n## All-reduce, bf16, µs per op (rank 0)\n\n"
    names = ["ours_one_shot", "ours_two_shot", "nccl", "torch_symm_one_shot", "torch_symm_two_shot"]
    rows = []
    for r in res["all_reduce"]:
        g = {n: r.get(f"{n}_graph_us", float("nan")) for n in names}
        e = {n: r.get(f"{n}_eager_us", float("nan")) for n in names}
        rows.append([f"{r['bytes'] >> 10} KB", *[g[n] for n in names],
                     min(g["ours_one_shot"], g["ours_two_shot"]) / g["nccl"], *[e[n] for n in names]])
    md += md_table(["size", *[f"graph {n}" for n in names], "best ours/NCCL (graph)",
                    *[f"eager {n}" for n in names]], rows)
    if res.get("all_reduce_norm"):
        md += ("\n## Row-layer epilogue: all-reduce + residual add + RMSNorm, bf16, µs (rank 0)\n\n"
               "`fused` is one kernel; `ours_alone` is our all-reduce alone (target: fused ≤ it + 1 µs); "
               "the others are an all-reduce followed by layer_ops.rmsnorm.\n\n")
        names = ["fused", "ours_alone", "ours_then_norm", "nccl_then_norm", "torch_symm_then_norm"]
        rows = []
        for r in res["all_reduce_norm"]:
            g = {n: r.get(f"{n}_graph_us", float("nan")) for n in names}
            rows.append([r["hidden"], r["tokens"], f"{r['bytes'] >> 10} KB", *[g[n] for n in names],
                         g["fused"] - g["ours_alone"], g["fused"] / g["nccl_then_norm"],
                         *[r.get(f"{n}_eager_us", float("nan")) for n in names]])
        md += md_table(["hidden", "T", "size", *[f"graph {n}" for n in names], "fused - ours alone (graph)",
                        "fused/NCCL+norm (graph)", *[f"eager {n}" for n in names]], rows)
    return md


def main(argv=None):
    args = bench_parser(__doc__).parse_args(argv)
    heap = (COPY_BYTES + HeapAllReduce.heap_bytes(args.tp, max(AR_SIZES), max(AR_SIZES))
            + sum(HeapAllReduceNorm.heap_bytes(args.tp, hidden, max(NORM_TOKENS), torch.bfloat16)
                  + HeapAllReduce.heap_bytes(args.tp, max(NORM_TOKENS) * hidden * 2) for hidden in NORM_HIDDEN)
            + (16 << 20))
    per_rank = run_ranks(_bench_rank, args.tp, (args.quick,), device="cuda", heap_size=-(-heap // 4096) * 4096,
                         timeout=500)
    payload = {"environment": environment(args.tp), "rank0": per_rank[0], "all_ranks": per_rank}
    md = _markdown(per_rank[0])
    publish(args.out, f"foundation-tp{args.tp}", payload, md)


if __name__ == "__main__":
    main()
