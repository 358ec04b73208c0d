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

from tp_overlap_plugin.ops.all_reduce import HeapAllReduce  # noqa: E402
from tp_overlap_plugin.kernels.barrier import launch_barrier  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402
from tp_overlap_plugin.tuning.allreduce import (SIZES, all_reduce_sweep, norm_heap_bytes, norm_sweep,  # noqa: E402
                                                torch_symm_all_reduce)

COPY_BYTES = 256 << 20
AR_SIZES = list(SIZES)
NORM_HIDDEN = [4096, 8192]
NORM_TOKENS = [1, 8, 32, 128, 256]


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
    symm = torch_symm_all_reduce(ctx, max(AR_SIZES))
    sizes = [AR_SIZES[0], AR_SIZES[3], AR_SIZES[5]] if quick else AR_SIZES
    out["all_reduce"] = all_reduce_sweep(ctx, comm, symm, sizes)
    out["all_reduce_norm"] = [row for hidden in NORM_HIDDEN
                              for row in norm_sweep(ctx, symm, hidden, NORM_TOKENS[:3] if quick else NORM_TOKENS)]
    h.check()
    return out


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
            + sum(norm_heap_bytes(args.tp, hidden, max(NORM_TOKENS)) for hidden in NORM_HIDDEN)
            + (16 << 20))
    per_rank = run_ranks(_bench_rank, args.tp, (args.quick,), device="cuda", heap_size=-(-heap // 4096) * 4096,
                         timeout=500)
    payload = {"environment": environment(args.tp), "rank0": per_rank[0], "all_ranks": per_rank}
    md = _markdown(per_rank[0])
    publish(args.out, f"foundation-tp{args.tp}", payload, md)


if __name__ == "__main__":
    main()
