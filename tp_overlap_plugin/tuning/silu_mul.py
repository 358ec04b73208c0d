"""gate_up_proj and its SiLU-mul on one GPU: the unfused pair (the matmul, then the SiLU-mul kernel) against
the fused launch the layer runs at that M (overlap_layers.OverlapColumn.silu_mul): ops.gemv.gemv_silu_mul
(the decode matmul's FMA path with the activation in its epilogue) where it applies, else
ops.gemm.gemm_silu_mul (our GEMM core with it in its epilogue); one launch either way, the [M, 2I]
product never written. Each in a CUDA graph, taking turns in interleaved repeats (`tp-overlap tune`'s
phase silu_mul: the dispatch table's gemm_silu_mul rows, rules.gemm_silu_mul_rows).

"stock" is the layer's unfused path: cuBLAS then the kernel; at decode-sized M, where the layer may run
our decode matmul instead (the table's gemv rows), the faster of that and cuBLAS in each repeat
("cublas_silu" and "gemv_silu" keep both), so the fused launch is chosen only where it beats either.
(bench/gemm_silu_mul.py, retired at 6bb3161, also timed the parts: our GEMM + the kernel, cuBLAS,
our GEMM, the kernel alone.)

The fused output of every measured row is checked against float64 on sampled rows first; a row that
fails says so ("ok": false), and the table's rule leaves it out (the dispatcher then never picks the
fused kernel there). On the CPU
(the interpreter) each op runs once by wall clock: a smoke run.
"""

from __future__ import annotations

import statistics

TABLE_OPS = ("stock", "fused")  # what the dispatch table compares
ALL_OPS = ("stock", "ours_silu", "fused", "cublas", "ours", "silu")
DECODE_OPS = ("cublas_silu", "gemv_silu", "fused")  # at decode-sized M: stock is the faster unfused pair


def calls_per_graph(m: int) -> int:
    return 20 if m <= 1024 else 5


def reference(x, w, rows: int):
    """About `rows` sampled rows of x and silu(gate) * up of them in float64 (w = gate_up's weight, [2n, K])."""
    import torch
    idx = torch.arange(0, x.shape[0], max(1, x.shape[0] // rows), device=x.device)
    gate, up = (x[idx].double() @ w.double().t()).chunk(2, dim=-1)
    return idx, torch.nn.functional.silu(gate) * up


def measure_row(shape: str, m: int, k: int, n2: int, dev, *, repeats: int, samples: int = 5,
                names=TABLE_OPS, gen=None) -> dict:
    """One (M, K, N = 2I) of gate_up: the fused kernel checked, then the ops `names` timed in `repeats`
    interleaved rounds (ms per call and, per op, its repeats: `<op>_ms`, `<op>_ms_repeats`)."""
    import torch

    from tp_overlap_plugin.gemm_config import pick_config
    from tp_overlap_plugin.kernels import layer_ops
    from tp_overlap_plugin.layers import activate_silu_mul
    from tp_overlap_plugin.decode_config import pick_decode_config
    from tp_overlap_plugin.ops.gemm import gemm, gemm_silu_mul, silu_mul_config
    from tp_overlap_plugin.ops.gemv import gemv, gemv_applies, gemv_silu_mul, gemv_silu_mul_applies
    from tp_overlap_plugin.tuning.timing import repeats_us
    gpu = dev.type == "cuda"
    w = (torch.randn(n2, k, device=dev, generator=gen) / k ** 0.5).to(torch.bfloat16)
    wt = w.t()  # the layers' view of the weight: no copy
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    gu = torch.empty(m, n2, device=dev, dtype=torch.bfloat16)
    y = torch.empty(m, n2 // 2, device=dev, dtype=torch.bfloat16)
    silu = layer_ops.silu_mul if gpu else activate_silu_mul
    decode_fused = gemv_silu_mul_applies(x, w)
    every = {"stock": lambda: silu(torch.matmul(x, wt, out=gu)), "ours_silu": lambda: silu(gemm(x, wt, out=gu)),
             "fused": (lambda: gemv_silu_mul(x, w, out=y)) if decode_fused else lambda: gemm_silu_mul(x, wt, out=y),
             "cublas": lambda: torch.matmul(x, wt, out=gu), "ours": lambda: gemm(x, wt, out=gu),
             "silu": lambda: silu(gu), "gemv_silu": lambda: silu(gemv(x, w, out=gu))}
    every["cublas_silu"] = every["stock"]
    if gemv_applies(x, w) and tuple(names) == TABLE_OPS:
        names = DECODE_OPS
    ops = {name: every[name] for name in names}
    cfg = pick_decode_config(m, n2, k, dev) if decode_fused else pick_config(m, n2, k, dev)
    row = {"shape": shape, "M": m, "K": k, "N": n2, "config": cfg.label(),
           "fused_runs": "gemv_silu_mul" if decode_fused else silu_mul_config(cfg).label()}
    y.fill_(float("nan"))
    every["fused"]()
    idx, ref = reference(x, w, 64)
    row["rel_err"] = ((y[idx].double() - ref).norm() / ref.norm()).item()
    if "ours_silu" in ops:
        row["vs_ours_silu"] = ((y.double() - every["ours_silu"]().double()).norm() / ref.norm()).item()
    row["ok"] = not y.isnan().any().item() and row["rel_err"] < 1e-2
    for fn in ops.values():
        fn(), fn()
    times = repeats_us(ops, gpu=gpu, graph=True, repeats=repeats, calls=calls_per_graph(m), samples=samples)
    for name, t in times.items():
        row[f"{name}_ms_repeats"] = [us / 1e3 for us in t]
        row[f"{name}_ms"] = statistics.median(row[f"{name}_ms_repeats"])
    if "gemv_silu" in times and "cublas_silu" in times:  # the layer's unfused path: the faster pair, per repeat
        pairs = zip(row["cublas_silu_ms_repeats"], row["gemv_silu_ms_repeats"])
        row["stock_ms_repeats"] = [min(a, b) for a, b in pairs]
        row["stock_ms"] = statistics.median(row["stock_ms_repeats"])
    if gpu:
        torch.cuda.empty_cache()
    return row
