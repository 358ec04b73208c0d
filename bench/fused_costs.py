"""Where a fused op's time goes at world size W, beyond the GEMM it computes. Per Llama TP shape at
M tokens, these timings in CUDA graphs, every rank at once (each rank's median, the max over ranks):

- `cublas`: the whole product on one GPU (torch.matmul), the floor's GEMM;
- `w1`: the fused op's kernel at world 1 over all M rows, with the op's own tile config: its loop
  shape and epilogue, no peer;
- `self_peer`: the op itself at world W, but every peer address translated to this rank's own heap
  (a heap_bases table of W copies of mine). It runs all of the op's code: the two tile loops, the
  waits between them, the GEMM-RS stores and sums, the AG pushes (into my own heap, where each
  peer would have put my rows); no byte crosses NVLink and no rank waits for another;
- `ours`: the op as the layers call it (`ours_1chunk`: GEMM-RS with its tiles in one run, the
  design before chunks, kernels/gemm_rs.py).

The graphs are captured once and timed in interleaved rounds (the median over rounds), so a drift
of the clocks during the run moves every variant alike.

So w1 / cublas is the kernel's GEMM, self_peer / w1 what the op's structure adds on one GPU, and
ours / self_peer what the link and the coupling with the peers add.

    python bench/fused_costs.py --tp 2 [--m 8192] [--out bench/results]
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (bench_parser, capture_graph, environment, interleaved_ms, md_table, publish,  # noqa: E402
                      slowest_rank)
from overlap import llama_shapes  # noqa: E402

from tp_overlap_plugin.multirank import run_ranks  # noqa: E402
from tp_overlap_plugin.kernels.ag_gemm import ag_gemm_kernel  # noqa: E402
from tp_overlap_plugin.kernels.gemm_rs import gemm_rs_kernel  # noqa: E402
from tp_overlap_plugin.ops.ag_gemm import AllGatherGemm  # noqa: E402
from tp_overlap_plugin.ops.device import num_programs  # noqa: E402
from tp_overlap_plugin.ops.gemm_rs import GemmReduceScatter  # noqa: E402
from tp_overlap_plugin.ops.operands import fused_config  # noqa: E402
from tp_overlap_plugin.tuning.fused_ops import weight_t  # noqa: E402

CALLS = 10  # per graph
VARIANTS = ("cublas", "w1", "self_peer", "ours", "ours_1chunk")


# The fused kernels at world 1 (no peer, no wait, no push): their tile loop and epilogue alone (the
# `w1` variant; fused_core.py timed them beside the GEMM core, notes/ag_gemm.md).
_W1_STATE = {}


def _w1_state(dev):
    """The device words a world-1 launch reads: heap_bases, error slot, call counter, flags."""
    key = str(dev)
    if key not in _W1_STATE:
        _W1_STATE[key] = (torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(8, dtype=torch.int64, device=dev),
                          torch.zeros(2, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev))
    return _W1_STATE[key]


def _w1_options(k, cfg):
    return dict(WORLD=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                EVEN_K=k % cfg.block_k == 0, INTERPRET=False, FLATTEN=True, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def ag_kernel_w1(a, b, c, cfg):
    """The AG-GEMM kernel at world 1: c = a @ b through its own-rows loop."""
    heap_bases, error, calls, flags = _w1_state(a.device)
    m, k = a.shape
    ag_gemm_kernel[(num_programs(a.device),)](a_ptr=a, b_ptr=b, c_ptr=c, gathered_ptr=a, rows=m, N=b.shape[1], K=k,
                                              stride_bk=b.stride(0), stride_bn=b.stride(1), slot_stride=0,
                                              flags_ptr=flags, calls_ptr=calls, rank=0, heap_bases=heap_bases,
                                              error_ptr=error, **_w1_options(k, cfg))


def rs_kernel_w1(a, b, c, cfg):
    """The GEMM-RS kernel at world 1: c = a @ b through its own-rows loop."""
    heap_bases, error, calls, flags = _w1_state(a.device)
    m, k = a.shape
    gemm_rs_kernel[(num_programs(a.device),)](a_ptr=a, b_ptr=b, c_ptr=c, recv_ptr=c, rows=m, N=b.shape[1], K=k,
                                              stride_am=a.stride(0), stride_bk=b.stride(0), stride_bn=b.stride(1),
                                              slot_stride=0, counts_ptr=flags, calls_ptr=calls, rank=0,
                                              heap_bases=heap_bases, error_ptr=error, CHUNKS=1,
                                              **_w1_options(k, cfg))


@contextlib.contextmanager
def _own_heap_only(heap, own_bases):
    """Peer addresses translate to my own heap (own_bases: W copies of my base) while this is open,
    and in graphs captured in it."""
    saved = heap.heap_bases
    heap.heap_bases = own_bases
    try:
        yield
    finally:
        heap.heap_bases = saved


def _rank(ctx, m, rounds):
    h, W, dev = ctx.heap, ctx.world_size, ctx.device
    own_bases = h.heap_bases[h.rank].repeat(W)
    rows = m // W
    gen = torch.Generator(device=dev).manual_seed(7 + ctx.rank)
    out = {}
    for model, layer, op, k, n in llama_shapes(W):
        if model == "70B" and layer in ("qkv", "o_proj"):
            continue
        key = f"{model}/{layer}/{m}"
        row = {"op": op, "M": m, "K": k, "N": n}
        with h.scope():
            b = weight_t(n, k, dev, gen)
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            cfg = fused_config(rows, n, k, dev, None)
            row["config"] = cfg.label()
            if op == "ag":
                real, own = AllGatherGemm(h, rows, k), AllGatherGemm(h, rows, k)
                shard = a[ctx.rank * rows:(ctx.rank + 1) * rows]
                w1 = lambda: ag_kernel_w1(a, b, c, cfg)  # noqa: E731
                fused = {"self_peer": lambda: own(shard, b), "ours": lambda: real(shard, b)}
            else:
                real, own = GemmReduceScatter(h, rows, n), GemmReduceScatter(h, rows, n)
                one = GemmReduceScatter(h, rows, n, chunks=1)
                w1 = lambda: rs_kernel_w1(a, b, c, cfg)  # noqa: E731
                fused = {"self_peer": lambda: own(a, b), "ours": lambda: real(a, b), "ours_1chunk": lambda: one(a, b)}
            fns = {"cublas": lambda: torch.matmul(a, b, out=c), "w1": w1, **fused}
            names = [v for v in VARIANTS if v in fns]  # ours_1chunk: GEMM-RS only
            replays = {}
            for name in names:
                with _own_heap_only(h, own_bases) if name == "self_peer" else contextlib.nullcontext():
                    for _ in range(2):  # compiled and warm on every rank before any rank times
                        fns[name]()
                    torch.cuda.synchronize()
                    dist.barrier(group=ctx.group)
                    replays[name] = capture_graph(fns[name], CALLS)
            row.update(interleaved_ms(replays, calls=CALLS, rounds=rounds, samples=3, group=ctx.group))
            torch.cuda.synchronize()
            h.check()
            dist.barrier(group=ctx.group)
        out[key] = row
        if ctx.rank == 0:
            print(key, {v: round(row[v], 4) for v in VARIANTS if v in row}, file=sys.stderr, flush=True)
    return out


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=500)
    args = p.parse_args(argv)
    per_rank = run_ranks(_rank, args.tp, (args.m, 3 if args.quick else 5), device="cuda", heap_size=1400 << 20,
                         timeout=args.timeout)
    rows = {key: slowest_rank([r[key] for r in per_rank]) for key in per_rank[0]}
    md = md_table(["shape", "op", "config", *[f"{v} ms" for v in VARIANTS], "w1/cuBLAS", "self_peer/w1",
                   "ours/self_peer", "ours/cuBLAS"],
                  [[key, r["op"], r["config"], *[r.get(v, "") for v in VARIANTS], r["w1"] / r["cublas"],
                    r["self_peer"] / r["w1"], r["ours"] / r["self_peer"], r["ours"] / r["cublas"]]
                   for key, r in rows.items()])
    publish(args.out, f"fused-costs-tp{args.tp}", {"environment": environment(args.tp), "rows": rows}, md)


if __name__ == "__main__":
    main()
