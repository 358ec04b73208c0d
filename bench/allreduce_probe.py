"""Where the one-shot all-reduce's time goes at W > 2, and where an eager call's host time goes.

    python bench/allreduce_probe.py --tp 4 [--tp 2] [--out DIR]

Kernel part (CUDA graphs, every variant warm on every rank, interleaved rounds): the one-shot at
8 KB-512 KB with its receive tile (SUB) and warp count varied, the two-shot, the fused all-reduce +
norm on one 4096-wide row, NCCL; each time per rank, so a rank that starts late shows as skew, and
each variant also timed with a device barrier at the head of its graph (no host skew at all).
Host part (eager): wall time per call of back-to-back calls (host-bound), for our op, the bare
`kernel[grid](...)`, and torch symm-mem; then cProfile's top entries for our op.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import environment  # noqa: E402

from tp_overlap_plugin.ops.all_reduce import HeapAllReduce, NUM_WARPS  # noqa: E402
from tp_overlap_plugin.ops.all_reduce_norm import HeapAllReduceNorm  # noqa: E402
from tp_overlap_plugin.kernels.allreduce import one_shot_all_reduce_kernel, sub_block  # noqa: E402
from tp_overlap_plugin.kernels.lamport import peers_pow2  # noqa: E402
from tp_overlap_plugin.ops.gemm_ar import GemmAllReduce  # noqa: E402
from tp_overlap_plugin.kernels.barrier import launch_barrier  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402
from tp_overlap_plugin.tuning.allreduce import torch_symm_all_reduce  # noqa: E402
from tp_overlap_plugin.tuning.timing import capture_graph  # noqa: E402

SIZES = (8 << 10, 128 << 10, 512 << 10)
CALLS = 50


def _one_shot(comm, x, y, sub, warps):
    """The one-shot kernel through Triton's own launch path, with its receive tile and warps given."""
    h = comm.heap
    slots = comm.one_shot_slots.view(torch.int16)
    block = 4096
    grid = (min(-(-x.numel() // block), comm.num_programs),)

    def op():
        one_shot_all_reduce_kernel[grid](
            x_ptr=x, out_ptr=y, slots_ptr=slots, epoch_ptr=comm.one_shot_epochs, n=x.numel(),
            slot_stride=slots.stride(0), src_stride=slots.stride(1), rank=h.rank, heap_bases=h.heap_bases,
            error_ptr=h.error, WORLD=h.world_size, PEERS=peers_pow2(h.world_size), BLOCK=block, SUB=sub,
            num_warps=warps, **comm.cache_modifiers)
    return op


def _graph_times(ctx, ops: dict, rounds: int = 5) -> dict:
    """Per op: median over rounds of this rank's time per call (us) in a graph of CALLS calls, plain
    and with a device barrier captured at the head (skew-free)."""
    h = ctx.heap
    replays = {}
    for name, op in ops.items():
        op()
        torch.cuda.synchronize()
        replays[name] = capture_graph(op, CALLS)

        def barriered(op=op):
            launch_barrier(h, h._barrier_flags, h._barrier_epoch)
            for _ in range(CALLS):
                op()
        g = torch.cuda.CUDAGraph()
        barriered()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            barriered()
        replays[name + "@barrier"] = g.replay
    for r in replays.values():
        r()
    torch.cuda.synchronize()
    dist.barrier(group=ctx.group)
    times = {n: [] for n in replays}
    for _ in range(rounds):
        for name, replay in replays.items():
            torch.cuda.synchronize()
            dist.barrier(group=ctx.group)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            replay()
            e.record()
            e.synchronize()
            times[name].append(1e3 * s.elapsed_time(e) / CALLS)
    return {n: statistics.median(t) for n, t in times.items()}


def _host_us(fn, calls=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _rank(ctx):
    h, W, dev = ctx.heap, ctx.world_size, ctx.device
    comm = HeapAllReduce(h, max_bytes=8 << 20)
    norm = HeapAllReduceNorm(h, 4096, 64, torch.bfloat16)
    out = {"rank": ctx.rank, "kernel": [], "host": {}}
    symm = torch_symm_all_reduce(ctx, 8 << 20)
    for nbytes in SIZES:
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)
        y = torch.empty_like(x)
        ref = x.float()
        dist.all_reduce(ref, group=ctx.device_group)
        ops = {}
        for sub in (1024, sub_block(4096, W, 256), 4096):
            for warps in (8,):
                op = _one_shot(comm, x, y, sub, warps)
                y.fill_(float("nan"))
                op()
                torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (sub, warps, err)
                ops[f"one_shot_sub{sub}_w{warps}"] = op
        ops["two_shot"] = lambda: comm(x, out=y, algorithm="two_shot")
        buf = x.clone()
        ops["nccl"] = lambda: dist.all_reduce(buf, group=ctx.device_group)
        if symm is not None:
            ops.update(symm(x))
        if nbytes == 8 << 10:
            xr = x.view(1, 4096)
            res = torch.randn_like(xr)
            w = torch.ones(4096, dtype=torch.bfloat16, device=dev)
            ops["fused_norm_1x4096"] = lambda: norm(xr, res, w, 1e-5)
        row = {"bytes": nbytes, **_graph_times(ctx, ops)}
        out["kernel"].append(row)
    # host side, eager, 8 KB
    x = torch.randn(4096, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    gar = GemmAllReduce(h, 64, 4096)
    xa = torch.randn(1, 1024, dtype=torch.bfloat16, device=dev)
    wa = torch.randn(4096, 1024, dtype=torch.bfloat16, device=dev)
    bare = _one_shot(comm, x, y, sub_block(4096, W, 256), NUM_WARPS)
    hosts = {"ours_one_shot": lambda: comm(x, out=y, algorithm="one_shot"),
             "ours_two_shot": lambda: comm(x, out=y, algorithm="two_shot"),
             "bare_kernel_launch": bare,
             "torch_empty_like": lambda: torch.empty_like(x),
             "fused_norm": lambda: norm(x.view(1, 4096), x.view(1, 4096), x, 1e-5),
             "gemm_all_reduce_1x1024x4096": lambda: gar(xa, wa)}
    if symm is not None:
        hosts.update({f"{k}": v for k, v in symm(x).items()})
    dist.barrier(group=ctx.group)
    for name, fn in hosts.items():
        dist.barrier(group=ctx.group)
        out["host"][name] = _host_us(fn)
    # a profile of our op's host path
    dist.barrier(group=ctx.group)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        comm(x, out=y, algorithm="one_shot")
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    out["profile_tottime"] = s.getvalue()[-6000:]
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
    out["profile_cumulative"] = s.getvalue()[-6000:]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, action="append")
    p.add_argument("--out", default=".")
    a = p.parse_args()
    result = {"env": environment(max(a.tp or [4])), "runs": {}}
    for W in a.tp or [4]:
        ranks = run_ranks(_rank, world_size=W, device="cuda", heap_size=256 << 20, timeout=400)
        result["runs"][str(W)] = ranks
        for row_i, row in enumerate(ranks[0]["kernel"]):
            print(f"W={W} bytes={row['bytes']}")
            for name in row:
                if name == "bytes":
                    continue
                per_rank = [r["kernel"][row_i][name] for r in ranks]
                print(f"  {name:40s} max {max(per_rank):7.2f}  min {min(per_rank):7.2f}")
        for name in ranks[0]["host"]:
            print(f"W={W} host {name:28s} " + " ".join(f"{r['host'][name]:6.1f}" for r in ranks))
        print(ranks[0]["profile_tottime"])
        print(ranks[0]["profile_cumulative"])
    with open(os.path.join(a.out, "allreduce-probe.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
