"""gate_up_proj and its SiLU-mul on one GPU, three ways, each in a CUDA graph, taking turns in one run:

  stock        cuBLAS (F.linear's matmul) [M, K] x [K, 2I], then layer_ops.silu_mul [M, 2I] -> [M, I]
               (the stock layers; the flag's too, before this)
  ours + silu  our GEMM core (ops.gemm, the table's tiles), then the same kernel
  fused        ops.gemm.gemm_silu_mul: the core with the activation in its epilogue, one launch, the
               [M, 2I] product never written

and the parts alone (cuBLAS, our GEMM, the SiLU-mul kernel). Shapes: Llama-3-8B's gate_up at TP=1
(2I = 28672) and TP=2 (2I = 14336), K = 4096. First, the fused kernel against float64 (bf16
tolerance, NaN-poisoned output) with the table's config at M = 1 and a non-tile-multiple M, and
there with a warp-specialized and a pointer-path config; every timed kernel's output is checked
against float64 on sampled rows too.

The timed rows are tuning/silu_mul.py's (what `tp-overlap tune` measures for the dispatch table's
gemm_silu_mul rows, stock and fused only; tune is the one producer of the table). The rows the rule
would make of this run (rules.gemm_silu_mul_rows: fused where it beat stock by the margin in every
interleaved round) are in the JSON, as evidence.

    python bench/gemm_silu_mul.py [--m 64,256,1024,2048,4096,8192]
    python bench/gemm_silu_mul.py --device cpu      # smoke run: interpreter, tiny shapes, wall clock
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, log, md_table, publish  # noqa: E402

SCHEMA = "gemm-silu-mul/1"
SHAPES = [("llama-3-8b gate_up TP=1", 4096, 28672), ("llama-3-8b gate_up TP=2", 4096, 14336)]
CPU_SHAPES = [("tiny gate_up", 72, 80)]
ROUNDS, SAMPLES = 5, 5


def correctness(dev, shapes, ms, extra_configs) -> list[dict]:
    """The fused kernel's output against silu(gate) * up in float64 (rows sampled at large M)."""
    import torch
    from tp_overlap_plugin.gemm_config import pick_config
    from tp_overlap_plugin.ops.gemm import gemm_silu_mul, silu_mul_config
    from tp_overlap_plugin.tuning.silu_mul import reference
    gen = torch.Generator().manual_seed(0)
    out = []
    for label, k, n2 in shapes:
        w = (torch.randn(n2, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(dev)
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(dev)
            idx, ref = reference(x, w, 512)
            for cfg in [pick_config(m, n2, k, dev)] + (extra_configs if (label, m) == (shapes[0][0], ms[-1]) else []):
                row = {"shape": label, "M": m, "K": k, "N": n2, "config": cfg.label(), "runs": silu_mul_config(cfg).label()}
                try:
                    y = torch.full((m, n2 // 2), float("nan"), dtype=torch.bfloat16, device=dev)
                    gemm_silu_mul(x, w.t(), out=y, config=cfg)
                    row["nan"] = int(y.isnan().sum())
                    row["rel_err"] = ((y[idx].double() - ref).norm() / ref.norm()).item()
                    row["ok"] = row["nan"] == 0 and row["rel_err"] < 1e-2
                except Exception as e:  # a config that does not compile is a result too
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                log("check", json.dumps(row))
                out.append(row)
    return out


def measure(dev, shapes, ms) -> list[dict]:
    from tp_overlap_plugin.tuning.silu_mul import ALL_OPS, measure_row
    rows = []
    for label, k, n2 in shapes:
        for m in ms:
            # the CPU (interpreter): one round, by wall clock, a smoke run
            row = measure_row(label, m, k, n2, dev, repeats=ROUNDS if dev.type == "cuda" else 1, samples=SAMPLES,
                              names=ALL_OPS)
            row["stock/fused"] = row["stock_ms"] / row["fused_ms"]
            row["ours_silu/fused"] = row["ours_silu_ms"] / row["fused_ms"]
            log("time", json.dumps({key: v for key, v in row.items() if not key.endswith("repeats")}))
            rows.append(row)
    return rows


def markdown(res: dict) -> str:
    md = f"# gate_up + SiLU-mul: cuBLAS + kernel, ours + kernel, fused (ms, CUDA graphs)\n\nCommand: `{res['command']}`\n\n"
    md += "## Fused kernel against float64\n\n" + md_table(
        ["shape", "M", "config", "fused runs", "rel. error", "NaN left", "ok"],
        [[r["shape"], r["M"], r["config"], r.get("runs", "-"), r.get("rel_err", r.get("error", "-")), r.get("nan", "-"), r["ok"]]
         for r in res["correctness"]])
    md += "\n## Time per call (median of interleaved rounds)\n\n" + md_table(
        ["shape", "M", "cuBLAS", "our GEMM", "SiLU-mul", "stock (cuBLAS + SiLU-mul)", "ours + SiLU-mul", "fused",
         "stock/fused", "ours+silu/fused", "table config", "fused runs", "rel. error", "chosen"],
        [[r["shape"], r["M"], r["cublas_ms"], r["ours_ms"], r["silu_ms"], r["stock_ms"], r["ours_silu_ms"], r["fused_ms"],
          r["stock/fused"], r["ours_silu/fused"], r["config"], r.get("fused_runs", "-"), r["rel_err"],
          next(t["winner"] for t in res["table_rows"] if (t["M"], t["N"]) == (r["M"], r["N"]))]
         for r in res["rows"]])
    md += (f"\nchosen: `fused` where stock/fused reached the margin {res['margin']} in every one of the "
           f"{ROUNDS} interleaved rounds (tuning/rules.gemm_silu_mul_rows).\n")
    return md


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--m", default="64,256,1024,2048,4096,8192")
    p.add_argument("--check-m", default="1,1000", help="M of the float64 checks (every timed M is checked too)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from tp_overlap_plugin.gemm_config import TileConfig
    from tp_overlap_plugin.tuning.rules import MARGIN, gemm_silu_mul_rows
    from tp_overlap_plugin.tuning.silu_mul import calls_per_graph
    dev = torch.device(args.device)
    shapes = SHAPES if gpu else CPU_SHAPES
    ms = [int(m) for m in args.m.split(",")] if gpu else [1, 33]
    check_ms = [int(m) for m in args.check_m.split(",")] if gpu else [1, 33]
    # the table's configs, and two it does not pick here: warp groups over kernel-built descriptors, and pointers
    extra = ([TileConfig(128, 256, 64, 8, 4, 4, tma=True, device_desc=True, c_tma=True, warp_spec=True),
              TileConfig(128, 256, 64, 16, 8, 3, flatten=True)] if gpu else [TileConfig(32, 32, 32, 4, 4, 1)])
    res = {"schema": SCHEMA, "environment": environment(args.tp, on_gpu=gpu),
           "command": "python bench/gemm_silu_mul.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "config": {"rounds": ROUNDS, "samples": SAMPLES, "calls_per_graph": {m: calls_per_graph(m) for m in ms}}}
    log("check", "fused kernel against float64")
    res["correctness"] = correctness(dev, shapes, check_ms, extra)
    log("time", "stock, ours + silu_mul, fused")
    res["rows"] = measure(dev, shapes, ms)
    res["margin"] = MARGIN
    res["table_rows"] = gemm_silu_mul_rows({f"{r['shape']}/{r['M']}": r for r in res["rows"]}, MARGIN)
    publish(args.out, "gemm-silu-mul", res, markdown(res))
    if not all(r["ok"] for r in res["correctness"] + res["rows"]):
        print("FUSED KERNEL CHECK FAILED", [r for r in res["correctness"] + res["rows"] if not r["ok"]])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
