"""Decode-sized linear layers on one GPU: cuBLAS (F.linear) against our decode matmul (overlap.gemv,
with the config its table picks), µs per call in CUDA graphs, for every local matmul of a rank at
TP=W (Llama-3 8B and 70B, Qwen2.5-7B, shapes from serving/model_configs: qkv, o_proj, gate_up,
down, and the LM head's vocab shard; a model whose heads do not divide by W is left out), at
M = 1, 2, 4, 8, 16, 32, 64 rows (--rows to choose).

Each call in a graph reads another copy of the weight, and the copies together overflow L2 (as a
model's layers do), so both stream the weight from HBM; the floor is weight bytes / the HBM copy
bandwidth measured in the same run (read + write bytes of a device-to-device copy, so a pure read
can beat it slightly). Results feed bench/make_dispatch_table.py --gemv: the engine's layers take
our GEMV where it won by the table's margin, F.linear elsewhere (dispatch.Dispatcher.gemv).

    python bench/gemv.py --tp 2 [--quick] [--rows 1,8,64] [--out bench/results]
    python bench/gemv.py --tp 2 --device cpu --quick     # smoke run: interpreter, tiny shapes, eager
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (bench_parser, cycle, environment, graph_time_per_call_ms, hbm_copy_bandwidth,  # noqa: E402
                      md_table, publish)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MODEL_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serving", "model_configs")
MODELS = {"8B": "llama-3-8b", "70B": "llama-3-70b", "Qwen7B": "qwen2.5-7b"}
ROWS = [1, 2, 4, 8, 16, 32, 64]
QUICK_ROWS = [1, 8, 64]
CPU_SHAPES = [("tiny qkv", 72, 40), ("tiny down", 300, 24)]
L2_FLUSH_BYTES = 256 << 20
CALLS = 20


def shapes(world: int, quick: bool) -> list[tuple[str, int, int]]:
    """(name, K, N) of one rank's local matmuls at TP=W: column layers divide N, row layers K, the
    head its vocab rows (padded up, as layers.ParallelLMHead holds it)."""
    out = []
    for model, folder in MODELS.items():
        if quick and model != "8B":
            continue
        with open(os.path.join(MODEL_CONFIGS, folder, "config.json")) as f:
            c = json.load(f)
        heads, kv_heads, hidden = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
        if heads % world or kv_heads % world:
            continue  # the engine refuses this TP size for the model (ModelConfig.check_tp)
        head_dim = c.get("head_dim") or hidden // heads
        q, kv = heads * head_dim, kv_heads * head_dim
        out += [(f"{model} qkv", hidden, (q + 2 * kv) // world),
                (f"{model} o_proj", q // world, hidden),
                (f"{model} gate_up", hidden, 2 * c["intermediate_size"] // world),
                (f"{model} down", c["intermediate_size"] // world, hidden),
                (f"{model} lm_head", hidden, -(-c["vocab_size"] // world))]
    return out


def weight_copies(n: int, k: int, dev: torch.device, gen) -> list[torch.Tensor]:
    """Copies of one random weight that together overflow L2 on a GPU (each captured call reads the
    next), made on the device (a 70B head shard is 2 GB)."""
    copies = max(3, -(-L2_FLUSH_BYTES // (n * k * 2))) if dev.type == "cuda" else 1
    w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
    return [w] + [w.clone() for _ in range(copies - 1)]


def measure(shape_list, rows, gpu: bool) -> list[dict]:
    from tp_overlap_plugin.decode_config import pick_decode_config
    from tp_overlap_plugin.overlap import gemv
    dev = torch.device("cuda" if gpu else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for name, k, n in shape_list:
        weights = weight_copies(n, k, dev, gen)
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
            ref = x.double() @ weights[0].double().t()  # on the device: a 70B head shard is 2 GB
            got = gemv(x, weights[0]).double()
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
                   "gemv_us": ours, "speedup": cublas / ours, "rel_err": err,
                   "config": pick_decode_config(m, n, k, dev).label()}
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
          f"ratios from the same run._\n", f"# Decode matmul against cuBLAS, TP={env['tp']} shards (µs per call, CUDA graphs)\n",
          f"Command: `{res['command']}`\n"]
    if bw:
        md.append(f"HBM copy bandwidth (read + write, this run): {bw / 1e12:.2f} TB/s. floor = weight bytes / that.\n")
    table = []
    for r in res["rows"]:
        floor = r["weight_bytes"] / bw * 1e6 if bw else float("nan")
        table.append([r["shape"], r["M"], r["K"], r["N"], f"{r['weight_bytes'] / 1e6:.1f}", f"{floor:.2f}",
                      f"{r['cublas_us']:.2f}", f"{r['gemv_us']:.2f}", f"{r['speedup']:.2f}",
                      f"{r['weight_bytes'] / r['cublas_us'] / 1e6:.2f}", f"{r['weight_bytes'] / r['gemv_us'] / 1e6:.2f}",
                      f"{floor / r['gemv_us']:.2f}", r.get("config", ""), f"{r['rel_err']:.1e}"])
    md.append(md_table(["shape", "M", "K", "N", "MB", "floor", "cuBLAS", "gemv", "cuBLAS/gemv", "cuBLAS TB/s",
                        "gemv TB/s", "gemv x copy", "config", "rel err"], table))
    return "\n".join(md)


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rows", help="comma-separated M values (default: 1,2,4,8,16,32,64; --quick: 1,8,64)")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shape_list = shapes(args.tp, args.quick) if gpu else CPU_SHAPES
    rows = (QUICK_ROWS if args.quick else ROWS) if gpu else [1, 3]
    if args.rows:
        rows = [int(m) for m in args.rows.split(",")]
    bw = hbm_copy_bandwidth() if gpu else None
    res = {"schema": "gemv/1", "environment": environment(args.tp, on_gpu=gpu), "hbm_copy_bytes_per_s": bw,
           "command": "python bench/gemv.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "config": {"quick": args.quick, "calls_per_graph": CALLS, "l2_flush_bytes": L2_FLUSH_BYTES},
           "rows": measure(shape_list, rows, gpu)}
    md = markdown(res)
    publish(args.out, f"gemv-tp{args.tp}", res, md)


if __name__ == "__main__":
    main()
