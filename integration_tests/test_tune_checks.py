"""tune's numeric checks (tuning/checks.py) over many random draws: a bf16 all-reduce summed in another
order than the reference's, with the residual add and RMSNorm after it, passes at every magnitude and
world size; a result that drops a peer's share, doubles one, or holds a NaN fails. The draw that
crashed tune's first run on H200x4 (two ulps at |x| 8-16 against a fixed 0.1) is among them."""

import pytest
import torch

from tp_overlap_plugin.tuning.checks import CheckFailed, check_close, ulps

EPS = 1e-5


def _rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def _draw(world: int, seed: int, rows: int = 4, hidden: int = 512, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    parts = [(scale * torch.randn(rows, hidden, generator=g)).to(torch.bfloat16) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    return parts, residual, weight


def _ring_bf16(parts, order):
    """A reference that rounds every partial sum to bf16, in the given order (as NCCL's ring may)."""
    acc = parts[order[0]]
    for r in order[1:]:
        acc = (acc.float() + parts[r].float()).to(torch.bfloat16)
    return acc


def _ours(parts):
    """Ours: the sum in fp32, rounded once."""
    return torch.stack([p.float() for p in parts]).sum(0).to(torch.bfloat16)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_a_sum_in_another_order_passes_at_every_magnitude(world):
    worst = 0.0
    for seed in range(150):
        scale = (0.01, 1.0, 4.0, 100.0)[seed % 4]   # 4 x randn rows + a residual reach 8-16 (the crash)
        parts, residual, weight = _draw(world, seed, scale=scale)
        order = torch.randperm(world, generator=torch.Generator().manual_seed(seed)).tolist()
        ref, got = _ring_bf16(parts, order), _ours(parts)
        ref_res = (ref.float() + residual.float()).to(torch.bfloat16)
        got_res = (got.float() + residual.float()).to(torch.bfloat16)
        check_close("all_reduce", got, ref, world)
        check_close("residual", got_res, ref_res, world)
        check_close("normed", _rmsnorm(got_res, weight), _rmsnorm(ref_res, weight), world)
        worst = max(worst, ulps(got_res, ref_res))
    if world > 2:  # (two bf16 operands sum alike in either order)
        assert worst > 0.5, "the draws never rounded differently: the test would not see a too-tight tolerance"


def test_the_crash_of_a_fixed_tolerance_is_two_ulps_here():
    """0.125 at |x| in [8, 16) is two bf16 ulps: the fixed 0.1 failed it, the ulp check passes it."""
    ref = torch.tensor([9.0, 12.0, 15.5], dtype=torch.bfloat16)
    got = (ref.float() + 0.125).to(torch.bfloat16)
    assert ulps(got, ref) == pytest.approx(2.0)
    check_close("residual", got, ref, 4)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_wrong_results_fail(world):
    for seed in range(40):
        parts, _, _ = _draw(world, 1000 + seed, scale=(0.5, 3.0)[seed % 2])
        ref = _ring_bf16(parts, list(range(world)))
        dropped = _ours(parts[:-1])                              # a peer's share missing
        doubled = _ours(parts + parts[:1])                       # a peer's share twice
        nan = _ours(parts).clone()
        nan[0, 7] = float("nan")
        for bad in (dropped, doubled, nan):
            with pytest.raises(CheckFailed, match="ulps"):
                check_close("all_reduce", bad, ref, world)
    # a one-element error of a few percent is caught by the ulp count even where the norm hides it
    got = _ours(parts).clone()
    got[0, 0] = (got[0, 0].float() * 1.05 + 1.0).to(torch.bfloat16)
    with pytest.raises(CheckFailed):
        check_close("all_reduce", got, ref, world)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_gemm_then_all_reduce_passes_with_its_rounded_partials(world):
    """The stock path of a row layer rounds every rank's product to bf16 before NCCL sums them; ours sums
    the fp32 products: GEMM + all-reduce's check allows those roundings (gemm_ar.py's extra_ulps)."""
    g = torch.Generator().manual_seed(world)
    for seed in range(20):
        xs = [torch.randn(4, 256, generator=g).to(torch.bfloat16) for _ in range(world)]
        w = [(torch.randn(512, 256, generator=g) / 16).to(torch.bfloat16) for _ in range(world)]
        parts32 = [x.float() @ wi.float().t() for x, wi in zip(xs, w)]
        ref = _ring_bf16([p.to(torch.bfloat16) for p in parts32], list(range(world)))
        got = torch.stack(parts32).sum(0).to(torch.bfloat16)
        residual = torch.randn(4, 512, generator=g).to(torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16)
        ref_res = (ref.float() + residual.float()).to(torch.bfloat16)
        got_res = (got.float() + residual.float()).to(torch.bfloat16)
        check_close("gemm_ar", got, ref, world, extra_ulps=world + 2)
        check_close("normed", _rmsnorm(got_res, weight), _rmsnorm(ref_res, weight), world, extra_ulps=world + 2)
