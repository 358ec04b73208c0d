"""Decode-sized linear layers on one GPU: cuBLAS (F.linear) against our decode matmul (ops.gemv,
with the config its table picks), µs per call in CUDA graphs, for every local matmul of a rank at
TP=W (Llama-3 8B and 70B, Qwen2.5-7B, shapes from serving/model_configs; a model whose heads do not
divide by W is left out), at the decode row counts (--rows to choose). The sweep is
tp_overlap_plugin/tuning/gemv.py's `measure` (what `tp-overlap tune` runs); its docstring says how
it is measured. Results feed a dispatch table through tuning/rules.py (from_bench_runs).

    python bench/gemv.py --tp 2 [--quick] [--rows 1,8,64] [--out bench/results]
    python bench/gemv.py --tp 2 --device cpu --quick     # smoke run: interpreter, tiny shapes, eager
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, hbm_copy_bandwidth, publish  # noqa: E402

from tp_overlap_plugin.tuning import gemv  # noqa: E402
from tp_overlap_plugin.tuning.shapes import shipped_dims  # noqa: E402

MODELS = {"8B": "llama-3-8b", "70B": "llama-3-70b", "Qwen7B": "qwen2.5-7b"}
CPU_SHAPES = [("tiny qkv", 72, 40), ("tiny down", 300, 24)]


def models_at(world: int, quick: bool) -> dict:
    """{label: ModelDims} of the models the engine can run at TP=world (ModelDims.check_tp)."""
    out = {}
    for label, name in MODELS.items():
        if quick and label != "8B":
            continue
        dims = shipped_dims(name)
        try:
            dims.check_tp(world)
        except ValueError:
            continue
        out[label] = dims
    return out


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rows", help="comma-separated M values (default: tuning.gemv.decode_rows)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shape_list = gemv.model_shapes(models_at(args.tp, args.quick), args.tp) if gpu else CPU_SHAPES
    rows = gemv.decode_rows(args.quick) if gpu else [1, 3]
    if args.rows:
        rows = [int(m) for m in args.rows.split(",")]
    bw = hbm_copy_bandwidth() if gpu else None
    res = {"schema": "gemv/1", "environment": environment(args.tp, on_gpu=gpu), "hbm_copy_bytes_per_s": bw,
           "command": "python bench/gemv.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "config": {"quick": args.quick, "calls_per_graph": gemv.CALLS, "l2_flush_bytes": gemv.L2_FLUSH_BYTES},
           "rows": gemv.measure(shape_list, rows, gpu, on_row=gemv.log_row)}
    publish(args.out, f"gemv-tp{args.tp}", res, gemv.markdown(res))


if __name__ == "__main__":
    main()
