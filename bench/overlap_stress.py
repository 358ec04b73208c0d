"""AG-GEMM and GEMM-RS stress run on GPUs: back-to-back calls with M drawn at random every call,
eager and as CUDA-graph replays, every result checked against an fp32 torch reference:

    python bench/overlap_stress.py --tp 4 [--calls 2000] [--fused-ops kernel|chunked] [--out bench/results] [--quick]
    python bench/overlap_stress.py --tp 2 --device cpu --calls 6   # smoke run: interpreter, tiny shapes, eager only

Shapes are Llama-3-8B's qkv (AG-GEMM) and o_proj (GEMM-RS) at TP=W, in the design --fused-ops names
(tp_overlap.fused_ops: the one-launch kernels, or the chunked ops with copy-engine pulls). Eager: each call takes a new
M (1 to the op's capacity; AG: rows per shard, RS: rows in all, padded to W) and fresh inputs. Graph:
one graph per op for each of 8 Ms, captured once, then replayed in random order with fresh inputs
copied into the graph's input buffers before each replay. Every rank draws every rank's inputs and
weights from per-rank seeds, so it computes the reference alone (fp32, the ranks summed in order),
between our calls on the same stream; no collective is needed, which lets `--share-gpus` run more
ranks than GPUs (a correctness check: ranks on one GPU are time-sliced). A call whose relative
error exceeds the tolerance, or is not finite, is a mismatch; the run reports the count (the target
is 0) and the worst error per mode; a call that fell back to the stock path instead of the op is
counted too (the target is 0: the draws stay within the op's capacity).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (add_share_gpus_option, bench_parser, environment, md_table, publish,  # noqa: E402
                      ranks_share_gpus, shared_gpus_banner)

from tp_overlap_plugin import stats  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402
from tp_overlap_plugin.options import DESIGNS  # noqa: E402
from tp_overlap_plugin.overlap_plan import design_ops  # noqa: E402

HIDDEN, QKV = 4096, 6144      # Llama-3-8B: qkv's N and o_proj's K are divided by W
MAX_ROWS = 1024               # per shard
CPU_DIMS = (64, 96, 8)        # the smoke run's (HIDDEN, QKV, MAX_ROWS): a few interpreter tiles
TOLERANCE = 2e-2              # bf16 outputs against an fp32 reference: ~4e-3 when right
GRAPH_MS = 8


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """On the device, no sync: NaN or Inf anywhere makes it inf."""
    err = (got.float() - ref).norm() / ref.norm().clamp_min(1e-6)
    return torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))


class _Op:
    """One fused op with fresh inputs for M, our call and the reference. Every rank holds every
    rank's weight and input generator (seeded by rank), drawn in the same order everywhere."""

    def __init__(self, ctx, kind, dims, design):
        self.ctx, self.kind = ctx, kind
        ag_op, rs_op = design_ops(design)
        hidden, qkv, self.max_rows = dims
        W, dev = ctx.world_size, ctx.device
        self.gens = [torch.Generator(device=dev).manual_seed(77 + r) for r in range(W)]
        if kind == "ag":
            self.k, self.n = hidden, qkv // W
            self.op = ag_op(ctx.heap, self.max_rows, self.k)
        else:
            self.k, self.n = hidden // W, hidden
            self.op = rs_op(ctx.heap, self.max_rows, self.n)
        # B as the TP layers pass it: an nn.Linear weight, transposed (a view)
        self.bs = [(torch.randn(self.n, self.k, device=dev, generator=g) / self.k ** 0.5).to(torch.bfloat16).t()
                   for g in self.gens]
        self.b32s = [b.float() for b in self.bs]

    def capacity(self) -> int:
        return self.max_rows if self.kind == "ag" else self.max_rows * self.ctx.world_size

    def inputs(self, m: int) -> list[torch.Tensor]:
        """Every rank's A for this call; this rank's is [ctx.rank]."""
        return [torch.randn(m, self.k, device=self.ctx.device, generator=g).to(torch.bfloat16) for g in self.gens]

    def __call__(self, a: torch.Tensor) -> torch.Tensor:
        return self.op(a, self.bs[self.ctx.rank])

    def reference(self, a_all: list[torch.Tensor]) -> torch.Tensor:
        rank, W = self.ctx.rank, self.ctx.world_size
        if self.kind == "ag":
            return torch.cat(a_all).float() @ self.b32s[rank]
        m = a_all[0].shape[0]
        rows = -(-m // W)
        full = torch.zeros(rows * W, self.n, dtype=torch.float32, device=a_all[0].device)
        for a, b in zip(a_all, self.b32s):  # rank order
            full[:m] += a.float() @ b
        return full[rank * rows:(rank + 1) * rows]


def _fallbacks() -> int:
    return sum(n for name, n in stats.snapshot().items() if name.endswith(".fallback"))


def _stress_rank(ctx, calls, seed, dims, design):
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = ctx.device.type == "cuda"
    ops = {"ag": _Op(ctx, "ag", dims, design), "rs": _Op(ctx, "rs", dims, design)}
    order = torch.Generator().manual_seed(seed)  # the same draws on every rank
    out = {}

    def draw_m(op):
        m = int(torch.randint(1, op.capacity() + 1, (), generator=order))
        return m

    # warm: every kernel on every rank compiles before any cross-rank wait is timed or checked
    for op in ops.values():
        op(op.inputs(ctx.world_size)[ctx.rank])
    if gpu:
        torch.cuda.synchronize()
    dist.barrier(group=ctx.group)

    t0, fell_back = time.perf_counter(), _fallbacks()
    errs, kinds = [], []
    for _ in range(calls):
        kind = list(ops)[int(torch.randint(0, len(ops), (), generator=order))]
        op = ops[kind]
        a_all = op.inputs(draw_m(op))
        errs.append(_rel_err(op(a_all[ctx.rank]), op.reference(a_all)))
        kinds.append(kind)
    errs = torch.stack(errs).cpu()
    if gpu:
        torch.cuda.synchronize()
    ctx.heap.check()
    out["eager"] = {"calls": calls, "seconds": time.perf_counter() - t0,
                    "mismatches": int((errs > TOLERANCE).sum()), "max_rel_err": float(errs.max()),
                    "fallbacks": _fallbacks() - fell_back, **{f"{kind}_calls": kinds.count(kind) for kind in ops}}
    if not gpu:  # the CPU smoke run: no CUDA graphs
        return out

    # graphs: per op, GRAPH_MS Ms (1 and the capacity among them), static input and output; a call takes its
    # path (and records it) when captured, not when replayed, so the graphs' fallbacks are counted from here
    graphs, fell_back = [], _fallbacks()
    for kind, op in ops.items():
        ms = sorted({1, op.capacity(), *(draw_m(op) for _ in range(GRAPH_MS - 2))})
        for m in ms:
            a = op.inputs(m)[ctx.rank]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                op(a)  # settle allocations on the capture stream
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                c = op(a)
            graphs.append((kind, m, a, c, graph))
    torch.cuda.synchronize()
    dist.barrier(group=ctx.group)
    t0 = time.perf_counter()
    errs = []
    for _ in range(calls):
        kind, m, a, c, graph = graphs[int(torch.randint(0, len(graphs), (), generator=order))]
        op = ops[kind]
        a_all = op.inputs(m)
        a.copy_(a_all[ctx.rank])
        graph.replay()
        errs.append(_rel_err(c, op.reference(a_all)))
    errs = torch.stack(errs).cpu()
    torch.cuda.synchronize()
    ctx.heap.check()
    out["graph"] = {"calls": calls, "seconds": time.perf_counter() - t0, "graphs": len(graphs),
                    "mismatches": int((errs > TOLERANCE).sum()), "max_rel_err": float(errs.max()),
                    "fallbacks": _fallbacks() - fell_back}
    return out


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--timeout", type=float, default=540)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--fused-ops", choices=DESIGNS, default="kernel",
                   help="the AG-GEMM / GEMM-RS design stressed (tp_overlap.fused_ops)")
    add_share_gpus_option(p)
    args = p.parse_args(argv)
    calls = 200 if args.quick else args.calls
    gpu = args.device == "cuda"
    hidden, qkv, max_rows = dims = (HIDDEN, QKV, MAX_ROWS) if gpu else CPU_DIMS
    ag_op, rs_op = design_ops(args.fused_ops)
    heap = (ag_op.heap_bytes(args.tp, max_rows, hidden, torch.bfloat16)
            + rs_op.heap_bytes(args.tp, max_rows, hidden, torch.bfloat16) + ((64 if gpu else 4) << 20))
    per_rank = run_ranks(_stress_rank, args.tp, (calls, args.seed, dims, args.fused_ops), device=args.device,
                         heap_size=-(-heap // 4096) * 4096, timeout=args.timeout, share_gpus=args.share_gpus)
    res = {mode: {**per_rank[0][mode],
                  "mismatches": sum(r[mode]["mismatches"] for r in per_rank),
                  "max_rel_err": max(r[mode]["max_rel_err"] for r in per_rank),
                  "fallbacks": sum(r[mode]["fallbacks"] for r in per_rank)} for mode in per_rank[0]}
    shared = ranks_share_gpus(args.tp, args.share_gpus, gpu)
    payload = {"environment": environment(args.tp, on_gpu=gpu, ranks_share_gpus=shared), "tolerance": TOLERANCE,
               "fused_ops": args.fused_ops,
               "max_rows": max_rows, "shapes": {"ag": [hidden, qkv // args.tp], "rs": [hidden // args.tp, hidden]},
               **res, "per_rank": per_rank}
    md = (shared_gpus_banner(args.tp) if shared else "") + md_table(
        ["mode", "calls per rank", "mismatches (all ranks)", "fallbacks (all ranks)", "max rel. error", "seconds"],
        [[mode, r["calls"], r["mismatches"], r["fallbacks"], r["max_rel_err"], r["seconds"]] for mode, r in res.items()])
    md = f"Design: `{args.fused_ops}`.\n\n" + md
    name = f"overlap-stress-tp{args.tp}" + ("-chunked" if args.fused_ops == "chunked" else "")
    publish(args.out, name + ("-shared-gpus" if shared else ""), payload, md)
    if any(r["mismatches"] or r["fallbacks"] for r in res.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
