"""Decode-sized linear layers on one GPU: cuBLAS (F.linear) against our GEMV (ops.gemv), µs per
call in CUDA graphs, for every local matmul of a rank at TP=W (`tp-overlap tune`: its model's qkv, o_proj, gate_up, down, and the LM head's vocab shard), at the
decode row counts DECODE_ROWS that the GEMV takes (ops.gemv.GEMV_MAX_ROWS).

Each call in a graph reads another copy of the weight, and the copies together overflow L2 (as a
model's layers do), so both stream the weight from HBM; the floor is weight bytes / the HBM copy
bandwidth measured in the same run (read + write bytes of a device-to-device copy, so a pure read
can beat it slightly). `measure` is the sweep; its rows feed the dispatch table's GEMV rows
(rules.gemv_rows): the engine's layers take our GEMV where it won by the table's margin in every
interleaved repeat, F.linear elsewhere (dispatch.Dispatcher.gemv). This phase alone:
`tp-overlap tune --tp W --model M --only gemv`.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from tp_overlap_plugin.tuning.results import md_table
from tp_overlap_plugin.tuning.timing import cycle, repeats_us

# The decode row counts the GEMV is measured at: those up to ops.gemv.GEMV_MAX_ROWS run (decode_rows()).
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
QUICK_ROWS = (1, 8, 64)
L2_FLUSH_BYTES = 256 << 20
CALLS = 20


def decode_rows(quick: bool = False) -> list[int]:
    """The row counts to measure: DECODE_ROWS (QUICK_ROWS with --quick) that ops.gemv takes."""
    from tp_overlap_plugin.ops.gemv import GEMV_MAX_ROWS
    rows = [m for m in (QUICK_ROWS if quick else DECODE_ROWS) if m <= GEMV_MAX_ROWS]
    return rows if not quick or GEMV_MAX_ROWS in rows else rows + [GEMV_MAX_ROWS]


def model_shapes(models: dict, world: int) -> list[tuple[str, int, int]]:
    """(name, K, N) of one rank's local matmuls at TP=W for each of `models` ({label: ModelDims}):
    the decoder's four and the LM head's vocab shard."""
    return [(f"{label} {layer}", k, n) for label, dims in models.items()
            for layer, k, n in dims.layers(world) + [dims.lm_head(world)]]


def weight_copies(n: int, k: int, dev: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    """Copies of one random weight that together overflow L2 on a GPU (each captured call reads the
    next), made on the device: a 70B head shard is 2 GB."""
    copies = max(3, -(-L2_FLUSH_BYTES // (n * k * 2))) if dev.type == "cuda" else 1
    w = (torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
    return [w] + [w.clone() for _ in range(copies - 1)]


def measure(shape_list, rows, gpu: bool, repeats: int = 1, on_row=None) -> list[dict]:
    """The decode-matmul sweep: per (name, K, N) in `shape_list` and M in `rows`, F.linear and ours
    (ops.gemv with the config its table picks), checked against float64 first (on the device: the
    CPU reference of a large shard takes tens of seconds), then timed in `repeats` interleaved rounds
    (CUDA graphs on a GPU; one eager call by wall clock on the CPU, a smoke run). `on_row(row)` is
    called after each row."""
    from tp_overlap_plugin.decode_config import pick_decode_config
    from tp_overlap_plugin.ops.gemv import gemv
    dev = torch.device("cuda" if gpu else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for name, k, n in shape_list:
        weights = weight_copies(n, k, dev, gen)
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
            ref = x.double() @ weights[0].double().t()
            got = gemv(x, weights[0]).double()
            err = ((got - ref).norm() / ref.norm()).item()
            nxt = cycle(weights)
            times = repeats_us({"cublas": lambda: F.linear(x, nxt()), "gemv": lambda: gemv(x, nxt())},
                               gpu=gpu, graph=True, repeats=repeats, calls=CALLS)
            cublas, ours = statistics.median(times["cublas"]), statistics.median(times["gemv"])
            row = {"shape": name, "M": m, "K": k, "N": n, "weight_bytes": n * k * 2, "cublas_us": cublas,
                   "gemv_us": ours, "speedup": cublas / ours, "rel_err": err,
                   "config": pick_decode_config(m, n, k, dev).label()}
            if repeats > 1:
                row.update(cublas_us_repeats=times["cublas"], gemv_us_repeats=times["gemv"])
            out.append(row)
            if on_row is not None:
                on_row(row)
        del weights
        if gpu:
            torch.cuda.empty_cache()
    return out


def log_row(row: dict) -> None:
    print(f"{row['shape']:12s} M={row['M']}: cuBLAS {row['cublas_us']:8.2f} us, gemv {row['gemv_us']:8.2f} us "
          f"({row['speedup']:.2f}x), err {row['rel_err']:.1e}", flush=True)


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
