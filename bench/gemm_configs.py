"""Our GEMM core against cuBLAS on one GPU, per tile config and launch variant:

    python bench/gemm_configs.py [--out bench/results] [--quick]

Shapes are the Llama-3 8B/70B tensor-parallel GEMMs of TP=--tp (M = 2048 and 8192). B is timed
in both layouts the package meets: row-major [K, N] (the fused ops' benchmark) and the transpose
of an nn.Linear weight [N, K] (what the TP layers pass, a view with no copy). `pick_config` is chosen
from this table; the md lists, per shape, cuBLAS, the current pick and the best config.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, md_table, time_per_call_ms, write_results  # noqa: E402
from overlap import llama_shapes  # noqa: E402

from tp_overlap_plugin.overlap import TileConfig, gemm, pick_config  # noqa: E402

BASE = [TileConfig(128, 256, 64, 8, 8, 3), TileConfig(128, 256, 64, 8, 8, 4), TileConfig(256, 128, 64, 8, 8, 3),
        TileConfig(128, 128, 64, 8, 4, 4), TileConfig(128, 128, 64, 8, 8, 4), TileConfig(128, 256, 64, 16, 8, 3)]


def variants(quick: bool) -> list[TileConfig]:
    out = []
    for c in BASE[:3] if quick else BASE:
        out += [c, dataclasses.replace(c, flatten=True), dataclasses.replace(c, persistent=False)]
    return out


def label(c: TileConfig) -> str:
    tag = "" if c.persistent and not c.flatten else (" flat" if c.flatten else " grid")
    return f"{c.block_m}x{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages}{tag}"


def main(argv=None):
    p = bench_parser(__doc__)
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    dev = torch.device("cuda")
    shapes = sorted({(m, k, n) for _, _, _, k, n in llama_shapes(args.tp) for m in ((8192,) if args.quick else (2048, 8192))})
    rows, raw = [], []
    t_start = time.perf_counter()
    for m, k, n in shapes:
        for layout in ("kn", "nk^T"):
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) / k ** 0.5
            if layout == "nk^T":
                b = b.t().contiguous().t()
            ref = (a @ b).float()
            entry = {"M": m, "K": k, "N": n, "layout": layout,
                     "cublas": time_per_call_ms(lambda: a @ b, calls=5, samples=7),
                     "pick": label(pick_config(m, n, k, dev)), "configs": {}}
            for cfg in variants(args.quick):
                try:
                    got = gemm(a, b, config=cfg).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        raise AssertionError(f"relative error {err:.2e}")
                    entry["configs"][label(cfg)] = time_per_call_ms(lambda: gemm(a, b, config=cfg), calls=5, samples=7)
                except Exception as e:  # a config that does not fit (shared memory) is a data point
                    entry["configs"][label(cfg)] = repr(e)[:200]
            timed = {c: t for c, t in entry["configs"].items() if isinstance(t, float)}
            best = min(timed, key=timed.get)
            pick_t = timed.get(entry["pick"], float("nan"))
            rows.append([f"{m}x{k}x{n}", layout, entry["cublas"], entry["pick"], pick_t, pick_t / entry["cublas"],
                         best, timed[best], timed[best] / entry["cublas"]])
            raw.append(entry)
            print(rows[-1], f"{time.perf_counter() - t_start:.0f} s", flush=True)
        paths, md = report(args, rows, raw)  # after every shape: a run cut off keeps what it measured
    print(md)
    print("wrote", *paths)


def report(args, rows, raw):
    md = "## Our GEMM vs cuBLAS (ms), per shape: the current pick and the best variant\n\n"
    md += md_table(["M x K x N", "B layout", "cuBLAS", "pick", "pick ms", "pick/cuBLAS", "best", "best ms",
                    "best/cuBLAS"], rows)
    names = list(raw[0]["configs"])
    md += "\n## Every variant, ms (`flat`: tile and K loops fused; `grid`: one program per tile)\n\n"
    md += md_table(["M x K x N", "B", "cuBLAS"] + names,
                   [[f"{e['M']}x{e['K']}x{e['N']}", e["layout"], e["cublas"]]
                    + [e["configs"][c] if isinstance(e["configs"][c], float) else "fail" for c in names]
                    for e in raw])
    paths = write_results(args.out, f"gemm-configs-tp{args.tp}-shapes", {"environment": environment(args.tp),
                                                                         "results": raw}, md)
    return paths, md


if __name__ == "__main__":
    main()
