"""Foundation microbenchmarks on GPUs (one command, every rank warm before timing):
  * remote load (pull) and store (push) bandwidth through the heap, all ranks at once;
  * device barrier latency, eager and inside a CUDA graph;
  * one-shot all-reduce 8 KB-8 MB vs NCCL and torch symmetric memory, eager and in a CUDA graph.

    python bench/foundation.py --tp 2 [--out bench/results]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, graph_time_per_call_ms, md_table, time_per_call_ms, write_results  # noqa: E402
from remote_bw import copy_kernel  # noqa: E402

from tp_overlap_plugin.collectives import HeapAllReduce  # noqa: E402
from tp_overlap_plugin.kernels.barrier import launch_barrier  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402

COPY_BYTES = 256 << 20
AR_SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20]


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

    comm = HeapAllReduce(h, max_bytes=max(AR_SIZES))
    symm = _torch_symm_all_reduce(ctx, max(AR_SIZES))
    sizes = AR_SIZES[:3] if quick else AR_SIZES
    for nbytes in sizes:
        numel = nbytes // 2
        x = torch.randn(numel, dtype=torch.bfloat16, device=ctx.device)
        y = torch.empty_like(x)
        nccl_buf = x.clone()
        comm(x, out=y)
        ref = x.float().clone()
        dist.all_reduce(ref, group=ctx.device_group)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"one-shot all-reduce wrong at {nbytes} B: rel err {err}"
        row = {"bytes": nbytes, "rel_err_vs_nccl_fp32": err}
        ops = {"ours_one_shot": lambda: comm(x, out=y),
               "nccl": lambda: dist.all_reduce(nccl_buf, group=ctx.device_group)}
        if symm is not None:
            ops.update(symm(x))
        for name, op in ops.items():
            op()
            torch.cuda.synchronize()
            row[f"{name}_eager_us"] = 1e3 * time_per_call_ms(op, calls=20, group=ctx.group)
            try:
                row[f"{name}_graph_us"] = 1e3 * graph_time_per_call_ms(op, calls=20, group=ctx.group)
            except Exception as e:  # keep the run going; the JSON says why
                row[f"{name}_graph_error"] = repr(e)[:200]
        out["all_reduce"].append(row)
    h.check()
    return out


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
    names = ["ours_one_shot", "nccl", "torch_symm_one_shot", "torch_symm_two_shot"]
    rows = []
    for r in res["all_reduce"]:
        g = {n: r.get(f"{n}_graph_us", float("nan")) for n in names}
        e = {n: r.get(f"{n}_eager_us", float("nan")) for n in names}
        rows.append([f"{r['bytes'] >> 10} KB", *[g[n] for n in names], g["ours_one_shot"] / g["nccl"],
                     *[e[n] for n in names]])
    md += md_table(["size", *[f"graph {n}" for n in names], "ours/NCCL (graph)",
                    *[f"eager {n}" for n in names]], rows)
    return md


def main(argv=None):
    args = bench_parser(__doc__).parse_args(argv)
    per_rank = run_ranks(_bench_rank, args.tp, (args.quick,), device="cuda",
                         heap_size=COPY_BYTES + (64 << 20), timeout=500)
    payload = {"environment": environment(args.tp), "rank0": per_rank[0], "all_ranks": per_rank}
    md = _markdown(per_rank[0])
    paths = write_results(args.out, f"foundation-tp{args.tp}", payload, md)
    print(md)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
