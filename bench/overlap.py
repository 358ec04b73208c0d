"""AG-GEMM / GEMM-RS / all-reduce benchmark on GPUs, one command, every kernel warm on every rank:

    python bench/overlap.py --tp 2 [--out bench/results] [--quick]
    python bench/overlap.py --tp 2 --device cpu     # smoke run: interpreter, two tiny shapes, eager only

Per Llama TP shape: cuBLAS GEMM alone, NCCL comm alone, sequential (NCCL + cuBLAS), torch
symmetric-memory fused op, our Triton GEMM alone, ours overlapped; ratios vs sequential and vs the
floor max(cuBLAS, NCCL). Then an M sweep on the 8B shapes (the dispatch table) and the all-reduce
sweep 8 KB-64 MB (one-shot, two-shot, NCCL, torch; eager and in a
CUDA graph). B is the transpose of an nn.Linear weight, as the TP layers pass it. Times are the
max over ranks of each rank's median.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, grouped_bars, md_table, slowest_rank, write_results  # noqa: E402

from tp_overlap_plugin.ops.all_reduce import HeapAllReduce  # noqa: E402
from tp_overlap_plugin.multirank import run_ranks  # noqa: E402
from tp_overlap_plugin.tuning.all_reduce import all_reduce_sweep, torch_symm_all_reduce  # noqa: E402
from tp_overlap_plugin.tuning.fused_ops import measure_shape, torch_fused_group  # noqa: E402
from tp_overlap_plugin.shapes import LAYER_OPS  # noqa: E402
from tp_overlap_plugin.tuning.shapes import shipped_dims  # noqa: E402

MODELS = {"8B": "llama-3-8b", "70B": "llama-3-70b"}


def llama_shapes(world: int):
    """(model, layer, op, K, N) of the Llama-3 8B/70B linear layers at TP=W (the shipped configs)."""
    return [(label, layer, LAYER_OPS[layer], k, n) for label, name in MODELS.items()
            for layer, k, n in shipped_dims(name).layers(world)]


AR_SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20, 64 << 20]
# the CPU smoke run: one column-parallel and one row-parallel layer of a few interpreter tiles (no M
# sweep: it measures as the shapes do), one call per sample, one all-reduce size, no torch fused ops
CPU_SHAPES = [("tiny", "gate_up", "ag", 64, 96), ("tiny", "down", "rs", 48, 64)]


def _measure_shape(ctx, op, m, k, n, gname, results, key, calls, torch_fused=False):
    measure_shape(ctx, op, m, k, n, gname, results.setdefault(key, {}), calls, torch_fused)


def _bench_rank(ctx, quick, partial, skip=()):
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    gname = torch_fused_group(ctx)
    W = ctx.world_size
    cpu = ctx.device.type == "cpu"
    out = {"shapes": {}, "sweep": {}, "all_reduce": [], "errors": []}
    ms = [2 * W] if cpu else [8192] if quick else [2048, 8192]
    sweep_ms = [W, 64, 512, 2048] if quick else [W, 16, 64, 256, 1024, 4096, 16384]
    layers = CPU_SHAPES if cpu else llama_shapes(W)
    shapes = [(f"{model}/{layer}/{m}", op, m, k, n) for model, layer, op, k, n in layers for m in ms
              if not quick or layer in ("gate_up", "down") or model == "8B"]
    sweep = [(f"{layer}/{m}", op, m, k, n) for model, layer, op, k, n in layers if model == "8B"
             for m in sweep_ms if not quick or layer in ("gate_up", "down")]
    def checkpoint():
        # rank 0's numbers so far, in case the run is cut off
        if ctx.rank == 0:
            with open(partial, "w") as f:
                json.dump(out, f)

    def phase_shapes(torch_fused):
        for key, op, m, k, n in shapes:
            _measure_shape(ctx, op, m, k, n, gname, out["shapes"], key, 1 if cpu else 5, torch_fused)
            checkpoint()
        for key, op, m, k, n in sweep:
            _measure_shape(ctx, op, m, k, n, gname, out["sweep"], key, 10 if m <= 1024 else 5, torch_fused)
            checkpoint()

    def phase_all_reduce():
        out["all_reduce"] = _all_reduce_sweep(ctx, gname, AR_SIZES[:1] if cpu else AR_SIZES[:6] if quick else AR_SIZES)
        checkpoint()

    # A CUDA error is sticky: after the first failed phase, return what was measured.
    phases = [("shapes", lambda: phase_shapes(False)), ("all_reduce", phase_all_reduce),
              ("torch_fused", lambda: phase_shapes(True))]
    for name, phase in phases:
        if name in skip:
            continue
        try:
            phase()
        except Exception:
            out["errors"].append(f"phase {name}: {traceback.format_exc()[-1500:]}")
            break
    return out


# tuning.all_reduce's names -> this script's (its results and markdown predate the shared sweep)
_AR_NAMES = {"ours_one_shot": "one_shot", "ours_two_shot": "two_shot", "torch_symm_one_shot": "torch_one_shot",
             "torch_symm_two_shot": "torch_two_shot"}


def _all_reduce_sweep(ctx, gname, sizes):
    h = ctx.heap
    with h.scope():
        # one-shot up to 8 MB (its receive slots take 2 * W times its capacity), two-shot everywhere
        comm = HeapAllReduce(h, max_bytes=max(sizes), one_shot_max_bytes=min(max(sizes), 8 << 20))
        symm = torch_symm_all_reduce(ctx, max(sizes)) if gname else None
        rows = [_renamed(r) for r in all_reduce_sweep(ctx, comm, symm, sizes, samples=9)]
        h.check()
    return rows


def _renamed(row: dict) -> dict:
    out = {}
    for key, v in row.items():
        for ours, theirs in _AR_NAMES.items():
            if key.startswith(ours + "_"):
                key = theirs + key[len(ours):]
                break
        # the sweep's check against NCCL in fp32 (tuning/checks.py: <what>_rel_err, <what>_ulps) -> <alg>_rel_err
        out[key.replace("_vs_nccl_fp32_", "_")] = v
    return out


def _combine(per_rank):
    """Per row, the slowest rank's timings (benchlib.slowest_rank)."""
    r0 = per_rank[0]
    def common(section):
        return [k for k in r0[section] if all(k in r[section] for r in per_rank)]

    def common_list(section):
        return range(min(len(r[section]) for r in per_rank))
    res = {"shapes": {k: slowest_rank([r["shapes"][k] for r in per_rank]) for k in common("shapes")},
           "sweep": {k: slowest_rank([r["sweep"][k] for r in per_rank]) for k in common("sweep")},
           "all_reduce": [slowest_rank([r["all_reduce"][i] for r in per_rank]) for i in common_list("all_reduce")],
           "errors": sum((r["errors"] for r in per_rank), [])}
    for row in list(res["shapes"].values()) + list(res["sweep"].values()):
        if all(isinstance(row.get(k), float) for k in ("cublas", "nccl", "sequential")):
            row["floor"] = max(row["cublas"], row["nccl"])
            if isinstance(row.get("ours"), float):
                row["ours_vs_sequential"] = row["sequential"] / row["ours"]
                row["ours_vs_floor"] = row["ours"] / row["floor"]
                row["comm_hidden"] = max(0.0, min(1.0, (row["sequential"] - row["ours"]) / row["nccl"]))
        if isinstance(row.get("ours_graph"), float) and isinstance(row.get("sequential_graph"), float):
            row["graph_seq_vs_ours"] = row["sequential_graph"] / row["ours_graph"]
        if isinstance(row.get("chunked"), float) and isinstance(row.get("floor"), float):
            row["chunked_vs_sequential"] = row["sequential"] / row["chunked"]
            row["chunked_vs_floor"] = row["chunked"] / row["floor"]
        if isinstance(row.get("chunked_graph"), float) and isinstance(row.get("sequential_graph"), float):
            row["graph_seq_vs_chunked"] = row["sequential_graph"] / row["chunked_graph"]
    return res


def _markdown(res):
    md = "## Llama TP shapes (ms)\n\n"
    hdr = ["shape", "op", "M", "K", "N", "cuBLAS", "NCCL", "sequential", "torch fused", "our GEMM", "ours",
           "floor", "seq/ours", "ours/floor", "comm hidden", "GEMM ours/cuBLAS", "seq graph", "ours graph",
           "seq/ours graph"]
    rows = []
    for key, r in res["shapes"].items():
        rows.append([key, r["op"], r["M"], r["K"], r["N"], r.get("cublas", float("nan")), r.get("nccl", float("nan")),
                     r.get("sequential", float("nan")), r.get("torch_fused", float("nan")),
                     r.get("triton_gemm", float("nan")), r.get("ours", float("nan")), r.get("floor", float("nan")),
                     r.get("ours_vs_sequential", float("nan")), r.get("ours_vs_floor", float("nan")),
                     r.get("comm_hidden", float("nan")), r.get("triton_gemm", float("nan")) / r.get("cublas", float("nan")),
                     r.get("sequential_graph", float("nan")), r.get("ours_graph", float("nan")),
                     r.get("graph_seq_vs_ours", float("nan")),
                     ])
    md += md_table(hdr, rows)
    md += "\n## The chunked ops (vendor GEMM per peer block, copy-engine pulls on a side stream: ops/chunked.py), ms\n\n"
    md += md_table(["shape", "sequential", "ours", "chunked", "seq/chunked", "chunked/floor", "seq graph",
                    "ours graph", "chunked graph", "seq/chunked graph"],
                   [[key, r.get("sequential", float("nan")), r.get("ours", float("nan")), r.get("chunked", float("nan")),
                     r.get("chunked_vs_sequential", float("nan")), r.get("chunked_vs_floor", float("nan")),
                     r.get("sequential_graph", float("nan")), r.get("ours_graph", float("nan")),
                     r.get("chunked_graph", float("nan")), r.get("graph_seq_vs_chunked", float("nan"))]
                    for key, r in list(res["shapes"].items()) + list(res["sweep"].items())])
    md += "\n## M sweep, Llama-3-8B shapes (ms): the dispatch table\n\n"
    rows = [[k, r.get("sequential", float("nan")), r.get("torch_fused", float("nan")), r.get("ours", float("nan")),
             r.get("ours_vs_sequential", float("nan")), "overlap" if r.get("ours_vs_sequential", 0) > 1.0 else "stock",
             r.get("sequential_graph", float("nan")), r.get("ours_graph", float("nan")),
             r.get("graph_seq_vs_ours", float("nan"))]
            for k, r in res["sweep"].items()]
    md += md_table(["layer/M", "sequential", "torch fused", "ours", "seq/ours", "winner (eager)", "seq graph",
                    "ours graph", "seq/ours graph"], rows)
    md += "\n## All-reduce, bf16, µs per op (CUDA graph | eager)\n\n"
    names = ["one_shot", "two_shot", "nccl", "torch_one_shot", "torch_two_shot"]
    rows = []
    for r in res["all_reduce"]:
        best = min(r.get("one_shot_graph_us", 1e9), r.get("two_shot_graph_us", 1e9))
        rows.append([f"{r['bytes'] >> 10} KB", *[r.get(f"{n}_graph_us", float("nan")) for n in names],
                     best / r.get("nccl_graph_us", float("nan")),
                     *[r.get(f"{n}_eager_us", float("nan")) for n in names]])
    md += md_table(["size", *[f"graph {n}" for n in names], "best ours/NCCL (graph)", *[f"eager {n}" for n in names]], rows)
    if res["errors"]:
        md += "\n## Errors\n\n" + "\n".join(f"- {e.splitlines()[-1]}" for e in res["errors"]) + "\n"
    return md


def _plot(res, path):
    keys = list(res["shapes"])
    series = {name: [res["shapes"][k].get(name, 0) / res["shapes"][k].get("sequential", 1) for k in keys]
              for name in ("sequential", "torch_fused", "ours", "floor")}
    return grouped_bars(path, keys, series, "time / sequential (lower is better)", rotation=60)


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--timeout", type=float, default=590)
    p.add_argument("--skip", default="", help="comma-separated phases to leave out: all_reduce, torch_fused")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args(argv)
    partial = os.path.join(args.out, "overlap-partial-rank0.json")
    try:
        skip = tuple(args.skip.split(",")) + (("torch_fused",) if args.device == "cpu" else ())
        per_rank = run_ranks(_bench_rank, args.tp, (args.quick, partial, skip),
                             device=args.device, heap_size=(1400 if args.device == "cuda" else 64) << 20,
                             timeout=args.timeout)
    except Exception as e:  # cut off: report rank 0's numbers so far, and say so
        with open(partial) as f:
            per_rank = [json.load(f)]
        per_rank[0]["errors"].append(f"run cut off, rank 0 only: {str(e)[-300:]}")
    res = _combine(per_rank)
    md = _markdown(res)
    paths = write_results(args.out, f"overlap-tp{args.tp}",
                          {"environment": environment(args.tp, on_gpu=args.device == "cuda"), **res}, md)
    png = _plot(res, paths[0].replace(".json", ".png"))
    print(md)
    print("wrote", *paths, png or "")


if __name__ == "__main__":
    main()
