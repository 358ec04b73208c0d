"""One-shot and two-shot all-reduce over the heap vs a float64 sum, on real rank processes."""

import pytest
import torch

from tp_overlap_plugin import stats
from tp_overlap_plugin.collectives import HeapAllReduce
from tp_overlap_plugin.multirank import run_ranks

SIZES = (1, 7, 4097)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def _inputs(seed, world, numel, dtype):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen).to(dtype) for _ in range(world)]


def _all_reduce_cases(ctx, seed, repeats):
    comm = HeapAllReduce(ctx.heap, max_bytes=64 << 10)
    out = []
    for dtype in DTYPES:
        for numel in SIZES:
            for rep in range(repeats):
                for algorithm in ("one_shot", "two_shot"):  # interleaved: they share chunk epochs
                    x = _inputs(seed + rep, ctx.world_size, numel, dtype)[ctx.rank].to(ctx.device)
                    y = torch.full_like(x, float("nan"))  # poisoned: every element must be written
                    comm(x, out=y, algorithm=algorithm)
                    out.append((dtype, numel, rep, y))
    ctx.heap.check()
    out = [(dt, n, rep, y.cpu()) for dt, n, rep, y in out]
    # not covered by the kernel: must fall back to torch.distributed, never answer wrongly
    dev = ctx.device
    big = torch.ones(20_000, dtype=torch.float32, device=dev) * (ctx.rank + 1)   # 80 KB > max_bytes
    ints = torch.arange(5, dtype=torch.int32, device=dev) * (ctx.rank + 1)
    strided = (torch.arange(10, dtype=torch.float32, device=dev) + ctx.rank)[::2]
    fallbacks = tuple(t.cpu() for t in (comm(big), comm(ints), comm(strided)))
    bad_device = None
    try:
        comm(x.to("meta"))
    except ValueError as e:
        bad_device = str(e)
    return out, fallbacks, stats.snapshot(), bad_device


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_matches_float64_sum(world, device):
    seed, repeats = int(torch.randint(0, 2**30, ())), (2 if device == "cpu" else 10)
    results = run_ranks(_all_reduce_cases, world, (seed, repeats), device=device, heap_size=1 << 20,
                        timeout=240)
    for i, (dtype, numel, rep, y) in enumerate(results[0][0]):
        ref = torch.stack([t.double() for t in _inputs(seed + rep, world, numel, dtype)]).sum(0)
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol)
        for r in range(1, world):
            # fixed summation order: bit-identical on every rank
            assert torch.equal(results[r][0][i][3], y), (dtype, numel, r)
    W = world
    for r, (_, (big, ints, strided), counts, bad_device) in enumerate(results):
        assert torch.equal(big, torch.full((20_000,), W * (W + 1) / 2))
        assert torch.equal(ints, torch.arange(5, dtype=torch.int32) * W * (W + 1) // 2)
        assert torch.equal(strided, sum(torch.arange(0, 10, 2, dtype=torch.float32) + q for q in range(W)))
        assert counts["all_reduce.one_shot"] == len(DTYPES) * len(SIZES) * repeats
        assert counts["all_reduce.two_shot"] == len(DTYPES) * len(SIZES) * repeats
        assert counts["all_reduce.fallback"] == 3
        assert "but the heap is on" in bad_device
