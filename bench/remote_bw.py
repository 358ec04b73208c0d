"""How fast SMs move data to and from a peer's heap, against how many programs do it, and the copy
engine beside them: the facts the fused ops' producer design rests on.

    python bench/remote_bw.py --tp 2 [--out bench/results]

Every rank copies BYTES to (store) or from (load) its next peer at once, so every link is busy both
ways, as inside AG-GEMM and GEMM-RS. Per program count: plain streaming, and "flagged", where each
program raises a flag at the peer after every 64 KB (a tile's worth), which makes it wait for its
stores to land before it goes on (what a tile's epilogue does). The copy engine row is
`peer_view(...).copy_()`, a device-to-device memcpy the driver routes over the link.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, md_table, publish, time_per_call_ms  # noqa: E402

from tp_overlap_plugin.kernels import rma  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402

BYTES = 64 << 20
PIECE = 64 << 10  # bytes between flags in the flagged mode: one 128x256 bf16 tile
PROGRAMS = [1, 4, 8, 16, 32, 66, 132, 264]


@triton.jit
def copy_kernel(src_ptr, dst_ptr, flag_ptr, n, rank, peer, heap_bases, PULL: tl.constexpr, FLAG: tl.constexpr,
                BLOCK: tl.constexpr):
    """dst[:n] = src[:n], the peer's side translated (PULL: src is the peer's, else dst); with FLAG a
    flag at the peer after every BLOCK. Also foundation.py's bandwidth probe."""
    if PULL:
        src_ptr = rma.translate(src_ptr, rank, peer, heap_bases)
    else:
        dst_ptr = rma.translate(dst_ptr, rank, peer, heap_bases)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
        if FLAG:
            rma.signal_set(flag_ptr + tl.program_id(0), start.to(tl.int64), rank, peer, heap_bases)


def _bench_rank(ctx):
    h, W = ctx.heap, ctx.world_size
    peer = (ctx.rank + 1) % W
    n = BYTES // 2
    heap_buf = h.alloc((n,), torch.bfloat16, name="bench.remote")
    flags = h.alloc((max(PROGRAMS),), torch.int64, name="bench.flags")
    heap_buf.normal_()
    local = torch.randn(n, device=ctx.device).to(torch.bfloat16)
    rows = []
    h.barrier()
    for pull in (False, True):
        for flag in (False, True):
            if pull and flag:
                continue
            for programs in PROGRAMS:
                src, dst = (heap_buf, local) if pull else (local, heap_buf)

                def copy():
                    copy_kernel[(programs,)](src, dst, flags, n, h.rank, peer, h.heap_bases, PULL=pull, FLAG=flag,
                                              BLOCK=PIECE // 2, num_warps=8)
                copy()
                torch.cuda.synchronize()
                dist.barrier(group=ctx.group)
                ms = time_per_call_ms(copy, calls=3, samples=7, group=ctx.group)
                rows.append({"mode": ("load" if pull else "store") + (" flagged" if flag else ""),
                             "programs": programs, "ms": ms, "GBps": BYTES / ms / 1e6})
                h.barrier()
    there = h.peer_view(heap_buf, peer)

    def ce():
        there.copy_(local, non_blocking=True)
    ce()
    torch.cuda.synchronize()
    dist.barrier(group=ctx.group)
    ms = time_per_call_ms(ce, calls=3, samples=7, group=ctx.group)
    rows.append({"mode": "copy engine", "programs": 0, "ms": ms, "GBps": BYTES / ms / 1e6})
    torch.cuda.synchronize()
    h.barrier()
    return rows


def main(argv=None):
    args = bench_parser(__doc__).parse_args(argv)
    per_rank = run_ranks(_bench_rank, args.tp, (), device="cuda", heap_size=BYTES + (16 << 20), timeout=300)
    rows = [{**r, "ms": max(pr[i]["ms"] for pr in per_rank)} for i, r in enumerate(per_rank[0])]
    for r in rows:
        r["GBps"] = BYTES / r["ms"] / 1e6
    md = md_table(["mode", "programs", "ms", "GB/s per GPU"], [[r["mode"], r["programs"], r["ms"], r["GBps"]]
                                                               for r in rows])
    publish(args.out, f"remote-bw-tp{args.tp}", {"environment": environment(args.tp), "bytes": BYTES, "rows": rows},
            md)


if __name__ == "__main__":
    main()
