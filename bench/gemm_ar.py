"""Decode row-parallel layers (o_proj, down) of Llama-3 8B and 70B at TP=W: GEMM + all-reduce in one
kernel against F.linear + NCCL / + our all-reduce, with and without the residual add + RMSNorm after
it, µs per layer on rank 0, in CUDA graphs and eager. The measuring is
tp_overlap_plugin/tuning/gemm_ar.py's `measure` (what `tp-overlap tune` runs; its docstring lists the
ops and the floor). Results feed a dispatch table through tuning/rules.py (from_bench_runs).

    python bench/gemm_ar.py --tp 2 [--quick] [--out bench/results]
    python bench/gemm_ar.py --tp 2 --device cpu --quick    # smoke run: interpreter, tiny shapes, eager only
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, publish  # noqa: E402

from tp_overlap_plugin.multirank import run_ranks  # noqa: E402
from tp_overlap_plugin.tuning import gemm_ar  # noqa: E402
from tp_overlap_plugin.tuning.shapes import shipped_dims  # noqa: E402


def row_layers(names: dict) -> list[tuple[str, int, int]]:
    """(name, full K, N) of the row-parallel layers of the shipped configs {label: config name}."""
    return [(f"{label} {layer}", k, n) for label, name in names.items()
            for layer, k, n in shipped_dims(name).layers(1) if layer in ("o_proj", "down")]


SHAPES = row_layers({"8B": "llama-3-8b", "70B": "llama-3-70b"})
ROWS = list(gemm_ar.ROWS)
QUICK_SHAPES, QUICK_ROWS = SHAPES[:2], [1, 16, 64]
CPU_SHAPES, CPU_ROWS = [("tiny", 80, 48)], [1, 3]  # the smoke run: a few interpreter tiles


def _bench_rank(ctx, shapes, rows):
    return gemm_ar.measure(ctx, shapes, rows)


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    shapes, rows = (QUICK_SHAPES, QUICK_ROWS) if args.quick else (SHAPES, ROWS)
    if not gpu:
        shapes, rows = CPU_SHAPES, CPU_ROWS
    local = [(name, k // args.tp, n) for name, k, n in shapes]  # each rank holds K / W
    heap = gemm_ar.heap_bytes(args.tp, local, rows)
    per_rank = run_ranks(_bench_rank, args.tp, (local, rows), device=args.device,
                         heap_size=-(-heap // 4096) * 4096, timeout=900 if gpu else 400)
    env = environment(args.tp, on_gpu=gpu)
    res = {"schema": "gemm-ar/1", "environment": env, "config": {"quick": args.quick, "shapes": shapes, "rows": rows,
           "hbm_bytes_per_s": gemm_ar.HBM_BYTES_PER_S, "link_bytes_per_s": gemm_ar.LINK_BYTES_PER_S,
           "one_way_us": gemm_ar.ONE_WAY_US}, "rows": per_rank[0], "all_ranks": per_rank}
    publish(args.out, f"gemm-ar-tp{args.tp}", res, gemm_ar.markdown(res))


if __name__ == "__main__":
    main()
