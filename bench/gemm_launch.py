"""Where an eager GEMM launch spends its time: the GEMM core called the way the fused ops call it
(eagerly, one launch per shard) against the same launch replayed from a CUDA graph, and cuBLAS.

gemm_configs.py times kernels inside CUDA graphs, which hides the host's work per launch; the
prefill path runs eagerly. This separates the two, per config (the table's pick and v2's pointer
config), and with the no-error gate that GEMM-RS's launches into a peer's heap carry.

    python bench/gemm_launch.py [--out bench/results]     # one GPU, ~1 minute
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import bench_parser, environment, graph_time_per_call_ms, md_table, time_per_call_ms, write_results  # noqa: E402

# (M, K, N): the per-shard GEMMs of Llama-3-8B at TP=2 (M = 8192 tokens, 4096 rows per shard), and whole
SHAPES = [(4096, 2048, 4096), (8192, 2048, 4096), (4096, 4096, 3072), (8192, 4096, 3072), (4096, 7168, 4096),
          (4096, 4096, 14336)]


def host_us_per_launch(fn, launches: int = 200) -> float:
    """Host time to enqueue one call, measured while the GPU is kept busy far ahead (so no launch waits)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(launches):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / launches


def main(argv=None):
    args = bench_parser(__doc__).parse_args(argv)
    from tp_overlap_plugin.gemm_config import HOPPER_LARGE, pick_config
    from tp_overlap_plugin.heap import SymmetricHeap
    from tp_overlap_plugin.overlap import _launch, _Wait

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", world_size=1, rank=0)
    heap = SymmetricHeap(dist.group.WORLD, dev, heap_size=64 << 20, backend="ipc")
    gate = _Wait(heap, torch.zeros(0, dtype=torch.int64, device=dev), 0, heap.rank)
    rows = []
    for m, k, n in SHAPES:
        a = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev)
        b = w.t()
        c = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        ref = a @ b
        variants = {"cuBLAS": lambda: torch.matmul(a, b, out=c)}
        for name, cfg in (("table", pick_config(m, n, k, dev)), ("v2 ptr", HOPPER_LARGE),
                          ("table no TMA", dataclasses.replace(pick_config(m, n, k, dev), tma=False, c_tma=False))):
            variants[name] = (lambda cfg=cfg: _launch(a, b, c, cfg))
            variants[name + " +gate"] = (lambda cfg=cfg: _launch(a, b, c, cfg, gate))
        for name, fn in variants.items():
            fn()
            torch.cuda.synchronize()
            err = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
            row = {"M": m, "K": k, "N": n, "variant": name, "rel_err": err,
                   "eager_ms": time_per_call_ms(fn, calls=20, samples=9),
                   "graph_ms": graph_time_per_call_ms(fn, calls=20, samples=9),
                   "host_us": host_us_per_launch(fn)}
            if name != "cuBLAS":
                row["config"] = str(pick_config(m, n, k, dev) if name.startswith("table") else HOPPER_LARGE)
            rows.append(row)
            print(f"{m}x{k}x{n} {name:18s} eager {row['eager_ms']:.4f} ms graph {row['graph_ms']:.4f} ms "
                  f"host {row['host_us']:.1f} us err {err:.1e}", flush=True)
    heap.close()
    dist.destroy_process_group()
    md = ("GEMM core launched eagerly vs replayed from a CUDA graph, with the host's enqueue time per call "
          "(bench/gemm_launch.py). B = nn.Linear weight transposed.\n\n")
    md += md_table(["M", "K", "N", "variant", "eager ms", "graph ms", "host µs/launch", "rel err"],
                   [[r["M"], r["K"], r["N"], r["variant"], r["eager_ms"], r["graph_ms"], r["host_us"], r["rel_err"]]
                    for r in rows])
    write_results(args.out, "gemm-launch", {"environment": environment(1), "rows": rows}, md)


if __name__ == "__main__":
    main()
