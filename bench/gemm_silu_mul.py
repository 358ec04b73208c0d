"""gate_up_proj and its SiLU-mul on one GPU, three ways, each in a CUDA graph, taking turns in one run:

  stock        cuBLAS (F.linear's matmul) [M, K] x [K, 2I], then layer_ops.silu_mul [M, 2I] -> [M, I]
               (the stock layers; the flag's too, before this)
  ours + silu  our GEMM core (overlap.gemm, the table's tiles), then the same kernel
  fused        overlap.gemm_silu_mul: the core with the activation in its epilogue, one launch, the
               [M, 2I] product never written

and the parts alone (cuBLAS, our GEMM, the SiLU-mul kernel). Shapes: Llama-3-8B's gate_up at TP=1
(2I = 28672) and TP=2 (2I = 14336), K = 4096. First, the fused kernel against float64 (bf16
tolerance, NaN-poisoned output) with the table's config at M = 1 and a non-tile-multiple M, and
there with a warp-specialized and a pointer-path config; every timed kernel's output is checked
against float64 on sampled rows too.

The dispatcher's rows (rules.gemm_silu_mul_rows: fused where it beat stock by the margin in every
interleaved round) are in the JSON; --into-table merges them into a dispatch table's
"gemm_silu_mul" rows (the shipped one for this device at TP=1, say) and writes it to --table-out.

    python bench/gemm_silu_mul.py [--m 64,256,1024,2048,4096,8192] [--into-table T.json --table-out T2.json]
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


def _calls(m: int) -> int:
    return 20 if m <= 1024 else 5


def _reference(x, w, rows: int):
    """About `rows` sampled rows of x and silu(gate) * up of them in float64 (w = gate_up's weight, [2n, K])."""
    import torch
    idx = torch.arange(0, x.shape[0], max(1, x.shape[0] // rows), device=x.device)
    gate, up = (x[idx].double() @ w.double().t()).chunk(2, dim=-1)
    return idx, torch.nn.functional.silu(gate) * up


def correctness(dev, shapes, ms, extra_configs) -> list[dict]:
    """The fused kernel's output against silu(gate) * up in float64 (rows sampled at large M)."""
    import torch
    from tp_overlap_plugin.gemm_config import pick_config
    from tp_overlap_plugin.overlap import gemm_silu_mul, silu_mul_config
    gen = torch.Generator().manual_seed(0)
    out = []
    for label, k, n2 in shapes:
        w = (torch.randn(n2, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(dev)
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(dev)
            idx, ref = _reference(x, w, 512)
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


def measure(dev, shapes, ms, gpu: bool) -> list[dict]:
    import torch
    from tp_overlap_plugin.kernels import layer_ops
    from tp_overlap_plugin.layers import activate_silu_mul
    from tp_overlap_plugin.gemm_config import pick_config
    from tp_overlap_plugin.overlap import gemm, gemm_silu_mul, silu_mul_config
    from tp_overlap_plugin.tuning.timing import capture_graph, interleaved_rounds
    rows = []
    for label, k, n2 in shapes:
        w = (torch.randn(n2, k, device=dev) / k ** 0.5).to(torch.bfloat16)
        wt = w.t()  # the layers' view of the weight: no copy
        for m in ms:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            gu = torch.empty(m, n2, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n2 // 2, device=dev, dtype=torch.bfloat16)
            silu = layer_ops.silu_mul if gpu else activate_silu_mul
            ops = {"stock": lambda: silu(torch.matmul(x, wt, out=gu)),
                   "ours_silu": lambda: silu(gemm(x, wt, out=gu)),
                   "fused": lambda: gemm_silu_mul(x, wt, out=y),
                   "cublas": lambda: torch.matmul(x, wt, out=gu),
                   "ours": lambda: gemm(x, wt, out=gu),
                   "silu": lambda: silu(gu)}
            for fn in ops.values():
                fn(), fn()
            cfg = pick_config(m, n2, k, dev)
            row = {"shape": label, "M": m, "K": k, "N": n2, "config": cfg.label(), "fused_runs": silu_mul_config(cfg).label()}
            # the timed kernel's output, against float64 on sampled rows and against ours + silu_mul
            y.fill_(float("nan"))
            ops["fused"]()
            idx, ref = _reference(x, w, 64)
            row["rel_err"] = ((y[idx].double() - ref).norm() / ref.norm()).item()
            row["vs_ours_silu"] = ((y.double() - ops["ours_silu"]().double()).norm() / ref.norm()).item()
            row["ok"] = not y.isnan().any().item() and row["rel_err"] < 1e-2
            if gpu:
                torch.cuda.synchronize()
                calls = _calls(m)
                replays = {name: capture_graph(fn, calls) for name, fn in ops.items()}
                times = interleaved_rounds(replays, calls=calls, rounds=ROUNDS, samples=SAMPLES)
                del replays
            else:
                import time
                times = {}
                for name, fn in ops.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name] = [(time.perf_counter() - t0) * 1e3]
            for name, t in times.items():
                row[f"{name}_ms_repeats"] = t
                row[f"{name}_ms"] = sorted(t)[len(t) // 2]
            row["stock/fused"] = row["stock_ms"] / row["fused_ms"]
            row["ours_silu/fused"] = row["ours_silu_ms"] / row["fused_ms"]
            log("time", json.dumps({key: v for key, v in row.items() if not key.endswith("repeats")}))
            rows.append(row)
            if gpu:
                torch.cuda.empty_cache()
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
    p.add_argument("--into-table", help="a dispatch table JSON to merge the gemm_silu_mul rows into")
    p.add_argument("--table-out", help="where the merged table goes (default: --into-table itself)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from tp_overlap_plugin import tables
    from tp_overlap_plugin.gemm_config import TileConfig
    from tp_overlap_plugin.tuning.rules import MARGIN, gemm_silu_mul_rows
    dev = torch.device(args.device)
    shapes = SHAPES if gpu else CPU_SHAPES
    ms = [int(m) for m in args.m.split(",")] if gpu else [1, 33]
    check_ms = [int(m) for m in args.check_m.split(",")] if gpu else [1, 33]
    # the table's configs, and two it does not pick here: warp groups over kernel-built descriptors, and pointers
    extra = ([TileConfig(128, 256, 64, 8, 4, 4, tma=True, device_desc=True, c_tma=True, warp_spec=True),
              TileConfig(128, 256, 64, 16, 8, 3, flatten=True)] if gpu else [TileConfig(32, 32, 32, 4, 4, 1)])
    res = {"schema": SCHEMA, "environment": environment(args.tp, on_gpu=gpu),
           "command": "python bench/gemm_silu_mul.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "config": {"rounds": ROUNDS, "samples": SAMPLES, "calls_per_graph": {m: _calls(m) for m in ms}}}
    log("check", "fused kernel against float64")
    res["correctness"] = correctness(dev, shapes, check_ms, extra)
    log("time", "stock, ours + silu_mul, fused")
    res["rows"] = measure(dev, shapes, ms, gpu)
    res["margin"] = MARGIN
    res["table_rows"] = gemm_silu_mul_rows({f"{r['shape']}/{r['M']}": r for r in res["rows"]}, MARGIN)
    publish(args.out, "gemm-silu-mul", res, markdown(res))
    if args.into_table:
        with open(args.into_table) as f:
            table = json.load(f)
        table["gemm_silu_mul"] = res["table_rows"]
        table["gemm_silu_mul_source"] = f"bench/gemm_silu_mul.py, {res['environment']['date']}"
        tables.write_atomic(args.table_out or args.into_table, json.dumps(table, indent=1) + "\n")
        print("merged gemm_silu_mul rows into", args.table_out or args.into_table)
    if not all(r["ok"] for r in res["correctness"] + res["rows"]):
        print("FUSED KERNEL CHECK FAILED", [r for r in res["correctness"] + res["rows"] if not r["ok"]])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
