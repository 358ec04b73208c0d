"""The GEMM core's paths against float64 references: pointer and tensor-descriptor operands (host-
and kernel-built descriptors), C by pointer or descriptor, whole or in halves, split-K, on odd
shapes, M = 1, K not a multiple of BLOCK_K, both B layouts (an nn.Linear weight transposed, and
row-major), and operands a descriptor cannot cover (the pointer fallback).

Under the interpreter (a fresh process: Triton picks it when a kernel is defined) with small tiles;
on a GPU with every config the H200 sweep can put in the table (`tp-overlap tune`'s gemm_configs phase).
The table lookup (buckets, crossover) is checked on a made-up table."""

import os
import sys

import pytest
import torch

# (M, K, N): M = 1, odd everything, K not a multiple of any BLOCK_K, K shorter than one block
SHAPES = [(1, 72, 40), (33, 40, 24), (70, 200, 48), (5, 24, 88), (130, 136, 72)]
# on a GPU every distinct (M == 1, M % 16, N % 16, B strides) compiles anew: few shapes, the W^T layout
# for every candidate, the other layouts for a few
GPU_SHAPES = [(1, 4104, 1032), (300, 2056, 1032)]
GPU_LAYOUT_SHAPES = [(77, 1000, 520)]
LAYOUTS = ("W^T", "row-major", "unaligned")


def _interpreter_configs():
    from tp_overlap_plugin.gemm_config import TileConfig as T
    return [T(32, 32, 32, 4, 4, 1), T(32, 32, 32, 4, 4, 1, tma=True), T(32, 64, 32, 2, 4, 1, tma=True, c_tma=True, subtile=True),
            T(16, 32, 16, 4, 4, 1, tma=True, split_k=3), T(32, 64, 16, 4, 4, 1, split_k=2, subtile=True),
            T(16, 32, 16, 4, 4, 1, tma=True, c_tma=True, split_k=0),
            T(32, 64, 32, 4, 4, 1, tma=True, device_desc=True, c_tma=True, warp_spec=True),
            T(32, 32, 16, 4, 4, 1, tma=True, device_desc=True, c_tma=True, subtile=True, split_k=2)]


def _bench_candidates():
    from tp_overlap_plugin.tuning.gemm_configs import candidates
    large, small = candidates()
    return large + small


def _check(dev, configs, shapes, layouts=LAYOUTS, dtype=torch.bfloat16):
    from tp_overlap_plugin.ops.gemm import _operand_descriptors, gemm
    gen = torch.Generator().manual_seed(0)
    bad = []
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen).to(dtype).to(dev)
        w = torch.randn(n, k, generator=gen).to(dtype).to(dev)
        ref = a.double().cpu() @ w.double().cpu().t()
        bs = {"W^T": w.t(), "row-major": w.t().contiguous(),
              # a row stride no descriptor can take (not 16-byte aligned): the pointer fallback
              "unaligned": torch.empty(k, n + 1, dtype=dtype, device=dev)[:, :n].copy_(w.t())}
        for cfg in configs:
            # "unaligned" is the descriptors' fallback; under the interpreter a pointer config reads it
            # as it reads row-major (a GPU compiles it anew: its row stride is not divisible by 16)
            for name in [n for n in layouts if dev.type != "cpu" or cfg.tma or n != "unaligned"]:
                b = bs[name]
                # every shape here has 16-byte aligned rows: descriptors unless the layout forbids them
                described = cfg.tma and _operand_descriptors(a, b, cfg) is not None
                assert described == (cfg.tma and name != "unaligned"), (cfg.label(), name)
                for rep in range(1 if cfg.split_k == 1 else 2):  # split-K's counters must be back at zero
                    out = torch.full((m, n), float("nan"), dtype=dtype, device=dev)
                    gemm(a, b, out=out, config=cfg)
                    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        bad.append((m, k, n, cfg.label(), name, rep, err))
    return bad


# SILU_MUL: (M, K, n), C is [M, n], B [K, 2n]: M = 1, M not a tile multiple, n not a multiple of any
# tile's n / 2 (the gate block then reads up's first columns, which must not be stored), a K tail
SILU_SHAPES = [(1, 40, 24), (33, 72, 40), (70, 24, 8)]
GPU_SILU_SHAPES = [(1, 4104, 1032), (300, 2056, 1040)]


def _silu_configs():
    from tp_overlap_plugin.gemm_config import TileConfig as T
    # pointers; host descriptors with C by descriptor in halves; kernel-built descriptors with warp groups;
    # a split-K config, which runs unsplit with the activation
    return [T(32, 32, 32, 4, 4, 1), T(32, 64, 16, 2, 4, 1, tma=True, c_tma=True, subtile=True),
            T(16, 32, 16, 4, 4, 1, tma=True, device_desc=True, c_tma=True, warp_spec=True),
            T(16, 32, 16, 4, 4, 1, tma=True, split_k=3)]


def _check_silu_mul(dev, configs, shapes, layouts=LAYOUTS, dtype=torch.bfloat16):
    """gemm_silu_mul against silu(gate) * up in float64, into a NaN-filled C inside a wider NaN buffer:
    every element of C written, none beside it."""
    from tp_overlap_plugin.ops.gemm import gemm_silu_mul
    gen = torch.Generator().manual_seed(1)
    bad = []
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen).to(dtype).to(dev)
        w = (torch.randn(2 * n, k, generator=gen) * 2 / k ** 0.5).to(dtype).to(dev)  # gate_up_proj's weight
        gate, up = (a.double().cpu() @ w.double().cpu().t()).chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        bs = {"W^T": w.t(), "row-major": w.t().contiguous(),
              "unaligned": torch.empty(k, 2 * n + 1, dtype=dtype, device=dev)[:, :2 * n].copy_(w.t())}
        for cfg in configs:
            for name in layouts:
                buf = torch.full((m, n + 8), float("nan"), dtype=dtype, device=dev)
                gemm_silu_mul(a, bs[name], out=buf[:, :n], config=cfg)
                out = buf[:, :n].double().cpu()
                err = ((out - ref).norm() / ref.norm()).item()
                if not err < 1e-2 or not buf[:, n:].isnan().all():
                    bad.append((m, k, n, cfg.label(), name, err))
    return bad


def main(dev="cpu"):
    bad = _check(torch.device(dev), _interpreter_configs(), SHAPES)
    assert not bad, bad
    configs = _silu_configs()
    bad = _check_silu_mul(torch.device(dev), configs[:1], SILU_SHAPES)
    bad += _check_silu_mul(torch.device(dev), configs[1:], SILU_SHAPES, layouts=("W^T",))
    assert not bad, bad
    print("gemm core ok")


@pytest.mark.timeout(300)
def test_gemm_core_paths_under_interpreter():
    from serving_helpers import run_under_interpreter
    run_under_interpreter(__file__, "gemm core ok", timeout=290)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs real kernels")
def test_gemm_core_paths_on_gpu():
    cands = _bench_candidates()
    bad = _check(torch.device("cuda"), cands, GPU_SHAPES, layouts=("W^T",))
    few = [c for c in cands if c.split_k != 1 or c.warp_spec or c.subtile][:4]
    bad += _check(torch.device("cuda"), few, GPU_LAYOUT_SHAPES)
    bad += _check_silu_mul(torch.device("cuda"), [c for c in cands if c.split_k == 1][:6] + few[:2], GPU_SILU_SHAPES,
                           layouts=("W^T",))
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs real kernels")
def test_split_k_and_descriptors_replay_in_a_cuda_graph():
    from tp_overlap_plugin.gemm_config import TileConfig
    from tp_overlap_plugin.ops.gemm import gemm
    m, k, n = 16, 4096, 1024
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
    ref = a.double() @ b.double()
    for cfg in (TileConfig(64, 128, 128, 8, 4, 4, tma=True, split_k=0),
                TileConfig(128, 128, 64, 8, 4, 4, tma=True, device_desc=True, warp_spec=True)):
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            gemm(a, b, out=out, config=cfg)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            gemm(a, b, out=out, config=cfg)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2, cfg.label()


def test_table_lookup_buckets_and_crossover():
    from tp_overlap_plugin.gemm_config import TileConfig, parse_table
    small, large = TileConfig(64, 128, 128, split_k=0, tma=True), TileConfig(128, 256, 64, tma=True, flatten=True)
    table = parse_table({
        "buckets": [1, 16, 2048], "margin": 1.1, "default_cublas_below": None,
        "configs": {small.label(): small.to_dict(), large.label(): large.to_dict()},
        "entries": [{"M": 1, "N": 512, "K": 256, "label": small.label()},
                    {"M": 16, "N": 512, "K": 256, "label": small.label()},
                    {"M": 2048, "N": 512, "K": 256, "label": large.label()}],
        "defaults": {"1": small.label(), "16": small.label(), "2048": large.label()},
        "cublas_below": [{"N": 512, "K": 256, "M": 16}]})
    assert table.config(1, 512, 256) == small and table.config(9, 512, 256) == small
    assert table.config(17, 512, 256) == large and table.config(100000, 512, 256) == large
    assert table.config(17, 999, 999) == large  # unmeasured shape: the bucket's default
    assert table.prefers_cublas(15, 512, 256) and not table.prefers_cublas(16, 512, 256)
    assert table.prefers_cublas(4096, 999, 999)  # unmeasured, no default crossover: stock


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
