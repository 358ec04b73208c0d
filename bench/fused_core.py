"""What the fused ops' tile loop costs by itself, on one GPU: the AG-GEMM and GEMM-RS kernels at
world size 1 (no peer, no wait, no push) against the plain GEMM core with the same tiles, flattened
and not, and cuBLAS.

    python bench/fused_core.py [--out bench/results]

At world 1 the fused kernels compute C = A @ B through one of their two tile loops; what they lose
against `gemm_kernel` with the same config (flattened or not) is the price of their loop shape and
epilogues, before any communication.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, graph_time_per_call_ms, md_table, publish  # noqa: E402

from tp_overlap_plugin.kernels.ag_gemm import ag_gemm_kernel  # noqa: E402
from tp_overlap_plugin.kernels.gemm_rs import gemm_rs_kernel  # noqa: E402
from tp_overlap_plugin.overlap import _eager_config, gemm, num_programs, pick_config  # noqa: E402

_W1_STATE = {}


def _w1_state(dev):
    """The device words a world-1 launch reads: heap_bases, error slot, call counter, flags."""
    key = str(dev)
    if key not in _W1_STATE:
        _W1_STATE[key] = (torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(8, dtype=torch.int64, device=dev),
                          torch.zeros(2, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev))
    return _W1_STATE[key]


def _w1_options(k, cfg, flat):
    return dict(WORLD=1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                EVEN_K=k % cfg.block_k == 0, INTERPRET=False, FLATTEN=flat, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def ag_kernel_w1(a, b, c, cfg, flat=True):
    """The AG-GEMM kernel at world 1: c = a @ b through its own-rows loop."""
    heap_bases, error, calls, flags = _w1_state(a.device)
    m, k = a.shape
    # no pusher (nothing to push at world 1): every program takes my own rows
    ag_gemm_kernel[(num_programs(a.device),)](a_ptr=a, b_ptr=b, c_ptr=c, gathered_ptr=a, counts_ptr=flags,
                                              calls_ptr=calls, rows=m, N=b.shape[1], K=k, stride_bk=b.stride(0),
                                              stride_bn=b.stride(1), slot_stride=0, pushers=0, join=0, rank=0,
                                              heap_bases=heap_bases, error_ptr=error, SEGMENTS=1, PIECE_ROWS=16,
                                              PUSH_COLS=16, **_w1_options(k, cfg, flat))


def rs_kernel_w1(a, b, c, cfg, flat=True):
    """The GEMM-RS kernel at world 1: c = a @ b through its own-rows loop."""
    heap_bases, error, calls, flags = _w1_state(a.device)
    m, k = a.shape
    gemm_rs_kernel[(num_programs(a.device),)](a_ptr=a, b_ptr=b, c_ptr=c, recv_ptr=c, rows=m, N=b.shape[1], K=k,
                                              stride_am=a.stride(0), stride_bk=b.stride(0), stride_bn=b.stride(1),
                                              slot_stride=0, counts_ptr=flags, calls_ptr=calls, rank=0,
                                              heap_bases=heap_bases, error_ptr=error, CHUNKS=1,
                                              **_w1_options(k, cfg, flat))


SHAPES = [(8192, 4096, 14336), (8192, 7168, 4096), (8192, 2048, 4096), (8192, 4096, 3072), (2048, 4096, 14336)]


def main(argv=None):
    args = bench_parser(__doc__).parse_args(argv)
    dev = torch.device("cuda", 0)
    rows = []
    for m, k, n in SHAPES:
        a = torch.randn(m, k, device=dev).to(torch.bfloat16)
        b = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16).t()
        c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        cfg = _eager_config(pick_config(m, n, k, dev))

        variants = {"cublas": lambda: torch.matmul(a, b, out=c),
                    "core_flat": lambda: gemm(a, b, out=c, config=dataclasses.replace(cfg, flatten=True)),
                    "core_plain": lambda: gemm(a, b, out=c, config=dataclasses.replace(cfg, flatten=False)),
                    "ag_kernel_w1": lambda: ag_kernel_w1(a, b, c, cfg), "rs_kernel_w1": lambda: rs_kernel_w1(a, b, c, cfg),
                    "ag_kernel_w1_plain": lambda: ag_kernel_w1(a, b, c, cfg, flat=False),
                    "rs_kernel_w1_plain": lambda: rs_kernel_w1(a, b, c, cfg, flat=False)}
        row = {"M": m, "K": k, "N": n, "config": cfg.label()}
        for name, fn in variants.items():
            c.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            row[name + "_rel_err"] = ((c.float() - ref).norm() / ref.norm()).item()
            row[name] = graph_time_per_call_ms(fn, calls=10, samples=7)
        rows.append(row)
        print(row, flush=True)
    names = ["cublas", "core_flat", "core_plain", "ag_kernel_w1", "rs_kernel_w1", "ag_kernel_w1_plain",
             "rs_kernel_w1_plain"]
    md = md_table(["M", "K", "N", "config", *[f"{x} ms" for x in names], *[f"{x}/cuBLAS" for x in names[1:]]],
                  [[r["M"], r["K"], r["N"], r["config"], *[r[x] for x in names], *[r[x] / r["cublas"] for x in names[1:]]]
                   for r in rows])
    publish(args.out, "fused-core", {"environment": environment(1), "rows": rows}, md)


if __name__ == "__main__":
    main()
