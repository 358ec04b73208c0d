"""All-reduce stress on GPUs: thousands of back-to-back all-reduces of random sizes (8 KB-16 MB,
any length, not chunk multiples), random algorithm (auto, one-shot, two-shot) and dtype, eager and
replayed from CUDA graphs, every result checked exactly, ranks pushed out of step on purpose:

    python bench/allreduce_stress.py --tp 2 [--quick] [--calls N] [--seed S] [--out bench/results] [--share-gpus]

(`--device cpu --max-bytes 32768 --calls 8`: a smoke run under the Triton interpreter, eager only.
`--share-gpus`: more ranks than GPUs, e.g. TP=4 on two, time-sliced: a correctness check only.)

Why: the v2 all-reduce passed the GPU tests and hung in bench/overlap.py, whose call pattern (sizes
and algorithms changing back to back, eager and graph) the tests did not have. This is that
pattern, at volume.

Inputs are small integers (|x| <= 8), so every sum is exact in every dtype and a result is right or
wrong, bit for bit; element i of rank r in call k is ((i * a_k + r * 7 + b_k) mod 17) - 8, with
a_k, b_k drawn per call, so a value left over from another call or another rank does not pass.
Calls run in bursts with no host sync inside a burst; outputs are poisoned (NaN) before each burst
and checked after it. Before some bursts one rank sleeps on the device, so its peers run ahead
into the next call while it is still in the previous one. A graph holds a burst; its inputs are
rewritten (new a_k, b_k) before every replay. Results: bench/results/allreduce-stress-tp<W>-*.json/md.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (add_share_gpus_option, bench_parser, environment, md_table, publish,  # noqa: E402
                      ranks_share_gpus, shared_gpus_banner)

from tp_overlap_plugin.ops.all_reduce import HeapAllReduce  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402

MIN_BYTES, MAX_BYTES = 8 << 10, 16 << 20
ONE_SHOT_BYTES = 2 << 20
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BURST = 8


def _plan(seed: int, calls: int, max_bytes: int) -> list[tuple[int, torch.dtype, str, int, int]]:
    """(numel, dtype, algorithm, a, b) per call, the same on every rank (the same seed): sizes
    log-uniform in [MIN_BYTES, max_bytes], any length."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = math.log2(min(MIN_BYTES, max_bytes // 4)), math.log2(max_bytes)
    plan = []
    for _ in range(calls):
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=g))]
        es = torch.empty((), dtype=dtype).element_size()
        numel = max(int(2 ** torch.empty(1).uniform_(lo, hi, generator=g).item()) // es, 1)
        numel = min(numel, max_bytes // es)
        algorithms = ["auto", "two_shot"] + (["one_shot"] if numel * es <= min(ONE_SHOT_BYTES, max_bytes) else [])
        algorithm = algorithms[int(torch.randint(0, len(algorithms), (1,), generator=g))]
        a, b = (int(v) for v in torch.randint(1, 17, (2,), generator=g))
        plan.append((numel, dtype, algorithm, a, b))
    return plan


def _values(numel, dtype, rank, a, b, dev):
    i = torch.arange(numel, device=dev, dtype=torch.int64)
    return (((i * a + rank * 7 + b) % 17) - 8).to(dtype)


def _expected(numel, dtype, world, a, b, dev):
    i = torch.arange(numel, device=dev, dtype=torch.int64)
    return sum(((i * a + r * 7 + b) % 17) - 8 for r in range(world)).to(dtype)


class _Checker:
    """Counts wrong results on the device (no host sync per call); read once per burst."""

    def __init__(self, dev):
        self.bad = torch.zeros((), dtype=torch.int64, device=dev)

    def check(self, out, numel, dtype, world, a, b):
        self.bad += (out.view(-1) != _expected(numel, dtype, world, a, b, out.device)).sum()


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _stress_rank(ctx, seed, eager_calls, graph_calls, sleep_every, max_bytes):
    h, W, dev = ctx.heap, ctx.world_size, ctx.device
    comm = HeapAllReduce(h, max_bytes=max_bytes, one_shot_max_bytes=min(ONE_SHOT_BYTES, max_bytes))
    gen = torch.Generator().manual_seed(seed + 1)  # the same on every rank: who sleeps, how long
    ins = {dt: [torch.empty(max_bytes // torch.empty((), dtype=dt).element_size(), dtype=dt, device=dev)
                for _ in range(BURST)] for dt in DTYPES}
    outs = {dt: [torch.empty_like(t) for t in ins[dt]] for dt in DTYPES}
    checker = _Checker(dev)
    counts: dict[str, int] = {}
    report = {"eager_calls": 0, "graph_calls": 0, "graphs": 0, "sleeps": 0, "bursts": 0}

    def desync():
        # one rank falls behind by up to ~0.1 ms of device time before the burst
        if sleep_every and int(torch.randint(0, sleep_every, (1,), generator=gen)) == 0:
            sleeper = int(torch.randint(0, W, (1,), generator=gen))
            cycles = int(torch.randint(1_000, 200_000, (1,), generator=gen))
            if ctx.rank == sleeper:
                if dev.type == "cuda":
                    torch.cuda._sleep(cycles)
                else:
                    time.sleep(cycles * 1e-7)
            report["sleeps"] += 1

    def burst_views(burst):
        views = []
        for j, (numel, dtype, algorithm, a, b) in enumerate(burst):
            x, y = ins[dtype][j][:numel], outs[dtype][j][:numel]
            views.append((x, y, numel, dtype, algorithm, a, b))
        return views

    # warm every kernel variant on every rank (no compile inside a capture or a timed wait)
    for dtype in DTYPES:
        for numel in (4096, 4099):
            for algorithm in ("one_shot", "two_shot"):
                comm(ins[dtype][0][:numel], out=outs[dtype][0][:numel], algorithm=algorithm)
    _sync(dev)
    h.check()

    plan = _plan(seed, eager_calls, max_bytes)
    t0 = time.perf_counter()
    for start in range(0, len(plan), BURST):
        views = burst_views(plan[start:start + BURST])
        for x, y, numel, dtype, algorithm, a, b in views:
            x.copy_(_values(numel, dtype, ctx.rank, a, b, dev))
            y.fill_(float("nan"))
        desync()
        for x, y, numel, dtype, algorithm, a, b in views:
            comm(x, out=y, algorithm=algorithm)
            key = f"{algorithm}/{str(dtype).replace('torch.', '')}"
            counts[key] = counts.get(key, 0) + 1
        for x, y, numel, dtype, algorithm, a, b in views:
            checker.check(y, numel, dtype, W, a, b)
        _sync(dev)
        h.check()
        if checker.bad.item():
            raise AssertionError(f"rank {ctx.rank}: wrong all-reduce results in eager calls {start}..{start + BURST - 1}: "
                                 f"{[(n, str(d), al) for n, d, al, _, _ in plan[start:start + BURST]]}")
        report["eager_calls"] += len(views)
        report["bursts"] += 1
    report["eager_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    replays = 8
    graph_plan = _plan(seed + 2, max(graph_calls // replays, BURST), max_bytes) if dev.type == "cuda" else []
    g2 = torch.Generator().manual_seed(seed + 3)
    for start in range(0, len(graph_plan), BURST):
        burst = graph_plan[start:start + BURST]
        views = burst_views(burst)
        for x, y, numel, dtype, algorithm, a, b in views:  # warm this burst's exact shapes
            comm(x, out=y, algorithm=algorithm)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x, y, numel, dtype, algorithm, a, b in views:
                comm(x, out=y, algorithm=algorithm)
        report["graphs"] += 1
        for _ in range(replays):
            fresh = [(int(v), int(w)) for v, w in torch.randint(1, 17, (len(views), 2), generator=g2)]
            for (x, y, numel, dtype, algorithm, _, _), (a, b) in zip(views, fresh):
                x.copy_(_values(numel, dtype, ctx.rank, a, b, dev))
                y.fill_(float("nan"))
            desync()
            graph.replay()
            for (x, y, numel, dtype, algorithm, _, _), (a, b) in zip(views, fresh):
                checker.check(y, numel, dtype, W, a, b)
            torch.cuda.synchronize()
            h.check()
            if checker.bad.item():
                raise AssertionError(f"rank {ctx.rank}: wrong all-reduce results in a graph replay of "
                                     f"{[(n, str(d), al) for n, d, al, _, _ in burst]}")
            report["graph_calls"] += len(views)
        del graph
    report["graph_s"] = time.perf_counter() - t0
    report["counts"] = counts
    report["sizes_bytes"] = sorted({n * torch.empty((), dtype=d).element_size() for n, d, _, _, _ in plan + graph_plan})
    return report


def _markdown(res: dict) -> str:
    r0 = res["rank0"]
    md = (f"{r0['eager_calls']} eager all-reduces in {r0['bursts']} bursts and {r0['graph_calls']} replayed from "
          f"{r0['graphs']} CUDA graphs, every result exact; {r0['sleeps']} bursts began with one rank held back on "
          f"the device. Sizes {min(r0['sizes_bytes'])}-{max(r0['sizes_bytes'])} bytes "
          f"({len(r0['sizes_bytes'])} distinct). Eager {r0['eager_s']:.1f} s, graphs {r0['graph_s']:.1f} s "
          f"(rank 0, checks included).\n\n")
    md += md_table(["algorithm/dtype", "eager calls"], [[k, v] for k, v in sorted(r0["counts"].items())])
    return md


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--calls", type=int, default=None, help="eager calls and graph-replayed calls, each "
                                                           "(default 6000, --quick 400)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sleep-every", type=int, default=4, help="hold one rank back before 1 burst in N (0: never)")
    p.add_argument("--max-bytes", type=int, default=MAX_BYTES)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--timeout", type=float, default=900)
    add_share_gpus_option(p)
    args = p.parse_args(argv)
    calls = args.calls or (400 if args.quick else 6000)
    t0 = time.perf_counter()
    heap = HeapAllReduce.heap_bytes(args.tp, args.max_bytes, min(ONE_SHOT_BYTES, args.max_bytes)) + (16 << 20)
    per_rank = run_ranks(_stress_rank, args.tp, (args.seed, calls, calls, args.sleep_every, args.max_bytes),
                         device=args.device, heap_size=-(-heap // 4096) * 4096, timeout=args.timeout,
                         share_gpus=args.share_gpus)
    on_gpu = args.device == "cuda"
    shared = ranks_share_gpus(args.tp, args.share_gpus, on_gpu)
    payload = {"environment": environment(args.tp, on_gpu=on_gpu, ranks_share_gpus=shared), "seed": args.seed,
               "calls": calls, "burst": BURST, "max_bytes": args.max_bytes, "wall_s": time.perf_counter() - t0,
               "rank0": per_rank[0], "all_ranks": per_rank}
    md = (shared_gpus_banner(args.tp) if shared else "") + _markdown(payload)
    name = f"allreduce-stress-tp{args.tp}" + ("-shared-gpus" if shared else "") + ("-quick" if args.quick else "")
    publish(args.out, name, payload, md)


if __name__ == "__main__":
    main()
