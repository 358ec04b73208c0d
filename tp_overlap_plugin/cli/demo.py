"""`tp-overlap demo`: start `--tp` ranks, build the symmetric heap, all-reduce random tensors through it
and check the sums against torch. On the CPU the kernels run under the Triton interpreter."""

from __future__ import annotations

import argparse

from .parser import add_debug_arg


def add_demo_subcommand(sub) -> argparse.ArgumentParser:
    d = sub.add_parser("demo", help="symmetric heap + all-reduce across --tp local ranks")
    d.add_argument("--tp", type=int, default=2, help="number of ranks")
    d.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present")
    d.add_argument("--numel", type=int, default=4097, help="elements per all-reduce")
    d.add_argument("--iters", type=int, default=3, help="all-reduces per dtype")
    d.add_argument("--heap-size", type=int, default=64 << 20, help="symmetric heap bytes per rank")
    d.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are killed")
    add_debug_arg(d)
    d.set_defaults(func=run_demo)
    return d


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from tp_overlap_plugin.multirank import run_ranks

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = run_ranks(_demo_rank, args.tp, (args.numel, args.iters), device=device,
                        heap_size=args.heap_size, timeout=args.timeout)
    for line in results[0]:
        print(line)
    return 0


def _demo_rank(ctx, numel, iters):
    import time

    import torch

    from tp_overlap_plugin import stats
    from tp_overlap_plugin.ops.all_reduce import HeapAllReduce

    comm = HeapAllReduce(ctx.heap, max_bytes=max(numel * 4, 1))
    lines = [f"{ctx.heap!r}", f"heap_bases = {[hex(b) for b in ctx.heap.heap_bases.tolist()]}"]
    for dtype in (torch.float32, torch.bfloat16):
        worst = 0.0
        t0 = time.perf_counter()
        for i in range(iters):
            gen = torch.Generator().manual_seed(1000 * i)
            xs = [torch.randn(numel, generator=gen).to(dtype) for _ in range(ctx.world_size)]
            y = comm(xs[ctx.rank].to(ctx.device))
            ref = torch.stack([x.double() for x in xs]).sum(0)
            worst = max(worst, ((y.double().cpu() - ref).norm() / ref.norm()).item())
        ctx.heap.check()
        dt = (time.perf_counter() - t0) / iters
        lines.append(f"all_reduce {dtype} x{numel}: rel. error {worst:.2e}, {dt * 1e3:.1f} ms/iter "
                     f"(host loop incl. reference)")
    lines.append(f"kernel calls: {stats.snapshot()}")
    return lines
