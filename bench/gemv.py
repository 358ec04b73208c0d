"""Decode-sized linear layers on one GPU: cuBLAS (F.linear) against our GEMV (overlap.gemv), µs per
call in CUDA graphs, for every local matmul of a rank at TP=W (Llama-3 8B and 70B: qkv, o_proj,
gate_up, down, and the LM head's vocab shard), at M = 1, 2, 4, 8 rows.

Each call in a graph reads another copy of the weight, and the copies together overflow L2 (as a
model's layers do), so both stream the weight from HBM; the floor is weight bytes / the HBM copy
bandwidth measured in the same run (read + write bytes of a device-to-device copy, so a pure read
can beat it slightly). Results feed bench/make_dispatch_table.py --gemv: the engine's layers take
our GEMV where it won by the table's margin, F.linear elsewhere (dispatch.Dispatcher.gemv).

    python bench/gemv.py --tp 2 [--quick] [--out bench/results]
    python bench/gemv.py --tp 2 --device cpu --quick     # smoke run: interpreter, tiny shapes, eager
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (bench_parser, cycle, environment, graph_time_per_call_ms, hbm_copy_bandwidth,  # noqa: E402
                      md_table, publish)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# (name, K, N) of one rank at TP=W: column layers divide N, row layers K, the head its vocab rows
VOCAB = 128256
LLAMA = {"8B": dict(hidden=4096, inter=14336, q=4096, kv=1024), "70B": dict(hidden=8192, inter=28672, q=8192, kv=1024)}
ROWS = [1, 2, 4, 8]
QUICK_ROWS = [1, 4, 8]
CPU_SHAPES = [("tiny qkv", 72, 40), ("tiny down", 300, 24)]
L2_FLUSH_BYTES = 256 << 20
CALLS = 20


def shapes(world: int, quick: bool) -> list[tuple[str, int, int]]:
    out = []
    for model, d in LLAMA.items():
        if quick and model != "8B":
            continue
        out += [(f"{model} qkv", d["hidden"], (d["q"] + 2 * d["kv"]) // world),
                (f"{model} o_proj", d["q"] // world, d["hidden"]),
                (f"{model} gate_up", d["hidden"], 2 * d["inter"] // world),
                (f"{model} down", d["inter"] // world, d["hidden"]),
                (f"{model} lm_head", d["hidden"], -(-VOCAB // world))]
    return out


def measure(shape_list, rows, gpu: bool) -> list[dict]:
    from tp_overlap_plugin.overlap import gemv
    dev = torch.device("cuda" if gpu else "cpu")
    gen = torch.Generator().manual_seed(0)
    out = []
    for name, k, n in shape_list:
        copies = max(3, -(-L2_FLUSH_BYTES // (n * k * 2))) if gpu else 1
        weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(dev) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(dev)
            ref = x.double().cpu() @ weights[0].double().cpu().t()
            got = gemv(x, weights[0]).double().cpu()
            err = ((got - ref).norm() / ref.norm()).item()
            if gpu:
                nxt = cycle(weights)
                cublas = 1e3 * graph_time_per_call_ms(lambda: F.linear(x, nxt()), calls=CALLS, samples=7)
                ours = 1e3 * graph_time_per_call_ms(lambda: gemv(x, nxt()), calls=CALLS, samples=7)
            else:  # the smoke run: one eager call each, wall time
                t0 = time.perf_counter()
                F.linear(x, weights[0])
                t1 = time.perf_counter()
                gemv(x, weights[0])
                cublas, ours = (t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6
            row = {"shape": name, "M": m, "K": k, "N": n, "weight_bytes": n * k * 2, "cublas_us": cublas,
                   "gemv_us": ours, "speedup": cublas / ours, "rel_err": err}
            out.append(row)
            print(f"{name:12s} M={m}: cuBLAS {cublas:8.2f} us, gemv {ours:8.2f} us ({cublas / ours:.2f}x), "
                  f"err {err:.1e}", flush=True)
        del weights
        if gpu:
            torch.cuda.empty_cache()
    return out


def markdown(res: dict) -> str:
    env, bw = res["environment"], res["hbm_copy_bytes_per_s"]
    md = [f"_{env['device']}, torch {env['torch']}, Triton {env['triton']}, {env['date']}. Medians; "
          f"ratios from the same run._\n", f"# Decode GEMV against cuBLAS, TP={env['tp']} shards (µs per call, CUDA graphs)\n",
          f"Command: `{res['command']}`\n"]
    if bw:
        md.append(f"HBM copy bandwidth (read + write, this run): {bw / 1e12:.2f} TB/s. floor = weight bytes / that.\n")
    table = []
    for r in res["rows"]:
        floor = r["weight_bytes"] / bw * 1e6 if bw else float("nan")
        table.append([r["shape"], r["M"], r["K"], r["N"], f"{floor:.2f}", f"{r['cublas_us']:.2f}",
                      f"{r['gemv_us']:.2f}", f"{r['speedup']:.2f}",
                      f"{r['weight_bytes'] / r['cublas_us'] / 1e6:.2f}", f"{r['weight_bytes'] / r['gemv_us'] / 1e6:.2f}",
                      f"{r['rel_err']:.1e}"])
    md.append(md_table(["shape", "M", "K", "N", "floor", "cuBLAS", "gemv", "cuBLAS/gemv", "cuBLAS TB/s", "gemv TB/s",
                        "rel err"], table))
    return "\n".join(md)


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shape_list = shapes(args.tp, args.quick) if gpu else CPU_SHAPES
    rows = (QUICK_ROWS if args.quick else ROWS) if gpu else [1, 3]
    bw = hbm_copy_bandwidth() if gpu else None
    res = {"schema": "gemv/1", "environment": environment(args.tp, on_gpu=gpu), "hbm_copy_bytes_per_s": bw,
           "command": "python bench/gemv.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "config": {"quick": args.quick, "calls_per_graph": CALLS, "l2_flush_bytes": L2_FLUSH_BYTES},
           "rows": measure(shape_list, rows, gpu)}
    md = markdown(res)
    publish(args.out, f"gemv-tp{args.tp}", res, md)


if __name__ == "__main__":
    main()
