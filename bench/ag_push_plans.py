"""AG-GEMM's push plans against each other at world size W (kernels/ag_gemm.py, ops.ag_gemm.PushPlan), so
the defaults come from a measurement: per Llama shape at M tokens, the op in CUDA graphs with

- `default`: ops.ag_gemm.push_plan's plan and AG_SEGMENTS runs of row blocks;
- `pushers=S`: S pushing programs (the default's pieces and join);
- `join=J`: the pushers take the peers' rows from run J on (J = 0: every run);
- `segments=R`: R runs of row blocks (a kernel of its own; its plan by push_plan);

and the sequential NCCL all-gather + cuBLAS of the same shape. Every variant is checked against the
sequential result first. Variants take turns in interleaved rounds (the median over rounds), every
rank at once; the time is the max over ranks.

    python bench/ag_push_plans.py --tp 4 [--m 8192] [--out bench/results] [--quick]
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (bench_parser, capture_graph, environment, interleaved_ms, md_table, publish,  # noqa: E402
                      slowest_rank)
from overlap import llama_shapes  # noqa: E402

from tp_overlap_plugin.multirank import run_ranks  # noqa: E402
from tp_overlap_plugin.ops.ag_gemm import AG_SEGMENTS, AllGatherGemm, push_plan  # noqa: E402
from tp_overlap_plugin.ops.device import num_programs  # noqa: E402
from tp_overlap_plugin.ops.operands import fused_config  # noqa: E402
from tp_overlap_plugin.tuning.fused_ops import weight_t  # noqa: E402

CALLS = 10  # per graph
PUSHERS = (8, 16, 32)
SEGMENTS = (1, 4)


def _variants(default, segments_default, quick):
    """(name, segments, plan or None for push_plan's at those segments). --quick leaves out 4 runs,
    whose kernel takes over twice as long to compile."""
    out = [("default", segments_default, default)]
    out += [(f"pushers={s}", segments_default, dataclasses.replace(default, pushers=s))
            for s in PUSHERS if s != default.pushers]
    out += [(f"join={j}", segments_default, dataclasses.replace(default, join=j))
            for j in range(segments_default) if j != default.join]
    out += [(f"segments={r}", r, None) for r in SEGMENTS if r != segments_default and not (quick and r > 2)]
    return out


def _rank(ctx, m, rounds, quick):
    h, W, dev = ctx.heap, ctx.world_size, ctx.device
    rows = m // W
    gen = torch.Generator(device=dev).manual_seed(5 + ctx.rank)
    out = {}
    for model, layer, op, k, n in llama_shapes(W):
        if op != "ag" or (quick and model == "70B"):
            continue
        key = f"{model}/{layer}/{m}"
        with h.scope():
            shard = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
            b = weight_t(n, k, dev, gen)
            full = torch.empty(m, k, device=dev, dtype=torch.bfloat16)

            def sequential():
                dist.all_gather_into_tensor(full, shard, group=ctx.device_group)
                return full @ b
            ref = sequential().float()
            cfg = fused_config(rows, n, k, dev, None)
            programs = num_programs(dev)
            default = push_plan(rows, n, k, 2, W, programs, cfg.block_m)
            variants = _variants(default, AG_SEGMENTS, quick)
            ops = {s: AllGatherGemm(h, rows, k, segments=s) for s in {seg for _, seg, _ in variants}}
            fns = {"sequential": sequential}
            row = {"op": op, "M": m, "K": k, "N": n, "config": cfg.label()}
            for name, segments, plan in variants:
                fns[name] = (lambda o=ops[segments], p=plan: o(shard, b, plan=p))
                row[f"{name}_plan"] = str(plan or push_plan(rows, n, k, 2, W, programs, cfg.block_m, segments))
            replays = {}
            for name, fn in fns.items():
                got = fn().float()  # compiled and warm on every rank before any rank times
                torch.cuda.synchronize()
                row[f"{name}_rel_err"] = ((got - ref).norm() / ref.norm()).item()
                dist.barrier(group=ctx.group)
                replays[name] = capture_graph(fn, CALLS)
            row.update(interleaved_ms(replays, calls=CALLS, rounds=rounds, samples=3, group=ctx.group))
            torch.cuda.synchronize()
            h.check()
            dist.barrier(group=ctx.group)
        out[key] = row
        if ctx.rank == 0:
            print(key, {v: round(row[v], 4) for v in fns}, file=sys.stderr, flush=True)
    return out


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=580)
    args = p.parse_args(argv)
    per_rank = run_ranks(_rank, args.tp, (args.m, 3 if args.quick else 5, args.quick), device="cuda",
                         heap_size=1400 << 20, timeout=args.timeout)
    rows = {key: slowest_rank([r[key] for r in per_rank]) for key in per_rank[0]}
    names = sorted({v for r in rows.values() for v in r if isinstance(r[v], float) and not v.endswith("_rel_err")})
    md = md_table(["shape", "config", *[f"{v} ms" for v in names], "worst rel. error"],
                  [[key, r["config"], *[r.get(v, "") for v in names],
                    max(r[v] for v in r if v.endswith("_rel_err"))] for key, r in rows.items()])
    md += "\n\nPlans: " + "; ".join(f"{v[:-5]} {p}" for v, p in next(iter(rows.values())).items() if v.endswith("_plan"))
    publish(args.out, f"ag-push-plans-tp{args.tp}", {"environment": environment(args.tp), "rows": rows}, md)


if __name__ == "__main__":
    main()
