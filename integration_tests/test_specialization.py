"""The fused ops keep no per-call value in their arguments (call numbers live in device memory), so
Triton never compiles a new variant while serving: on GPUs, 40 calls compile nothing after the first."""

import pytest
import torch

from tp_overlap_plugin.multirank import run_ranks

CALLS = 40


def _variants(*kernels):
    return [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]


def _forty_calls(ctx):
    from tp_overlap_plugin.kernels.ag_gemm import ag_gemm_kernel
    from tp_overlap_plugin.kernels.gemm_rs import gemm_rs_kernel
    from tp_overlap_plugin.ops.ag_gemm import AllGatherGemm
    from tp_overlap_plugin.ops.gemm_rs import GemmReduceScatter

    kernels = (ag_gemm_kernel, gemm_rs_kernel)
    dev, W = ctx.device, ctx.world_size
    ag = AllGatherGemm(ctx.heap, max_rows=64, k=128)
    rs = GemmReduceScatter(ctx.heap, max_rows=64, n=128)
    a = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)
    b = torch.randn(128, 128, device=dev, dtype=torch.bfloat16)
    ag(a, b)
    rs(torch.randn(64 * W, 128, device=dev, dtype=torch.bfloat16), b)
    after_first = _variants(*kernels)
    for _ in range(CALLS - 1):
        ag(a, b)
        rs(torch.randn(64 * W, 128, device=dev, dtype=torch.bfloat16), b)
    torch.cuda.synchronize()
    ctx.heap.check()
    return after_first, _variants(*kernels), ag.calls[1].item(), rs.calls[1].item()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_forty_calls_compile_nothing_after_the_first():
    for after_first, after_all, ag_calls, rs_calls in run_ranks(_forty_calls, 2, device="cuda",
                                                                 heap_size=64 << 20, timeout=300):
        assert ag_calls == rs_calls == CALLS  # the call numbers the kernels advanced
        assert after_all == after_first, f"compiled variants (ag_gemm, gemm_rs): {after_first} -> {after_all}"
