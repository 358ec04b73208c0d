"""The numeric check tune runs on an op before it times it: ours against a reference, in units of the
output's own precision.

A fixed absolute tolerance is wrong for low precision: the sum of four randn rows plus a residual
reaches 8-16, where one bf16 ulp is 0.0625, so two ulps (a sum taken in another order than NCCL's) read
as 0.125 and failed a check of 0.1 on some draws (tune's first run on H200x4, 2026-11-28). Here each
element's difference is counted in ulps of the output dtype at the reference's magnitude, floored at the
reference's RMS (a sum that cancels to near zero still carries its operands' rounding), and the whole is
also held to a relative error: a result that drops or doubles a peer's share is off by hundreds of ulps,
a result that only rounds differently by a few.
"""

from __future__ import annotations

import torch

# a reduced-precision all-reduce of W partials: the reference (NCCL) rounds each of its W - 1 partial sums
# (half an ulp each), ours once; a norm after it adds an ulp or two (the RMS of a residual that differs
# by those ulps, the weight's product): W + 2 ulps bounds both with room, and stays far under the
# hundreds of ulps that a missing or doubled peer costs
def ulp_tolerance(world: int) -> float:
    return float(world + 2)


# ‖got − ref‖ / ‖ref‖: each of two bf16 results lies within 1e-3 to 1e-2 of the exact one (METHOD), so
# they may lie 2e-2 apart; a dropped or doubled peer's share is off by 1 / sqrt(W) and more
REL_TOLERANCE = 2e-2


class CheckFailed(AssertionError):
    """An op's result is not the reference's: the row is recorded as failed and runs stock."""


def ulps(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """The largest element-wise difference in ulps of `dtype` (default: got's) at |ref|, each element's
    magnitude floored at ref's RMS; inf where got has a NaN or inf."""
    dtype = dtype or got.dtype
    g, r = got.detach().double().flatten(), ref.detach().double().flatten()
    if not torch.isfinite(g).all():
        return float("inf")
    if r.numel() == 0:
        return 0.0
    rms = r.square().mean().sqrt().item()
    tiny = torch.finfo(dtype).tiny
    mag = r.abs().clamp(min=max(rms, tiny))
    spacing = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(mag)))
    return ((g - r).abs() / spacing).max().item()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.detach().double(), ref.detach().double()
    if not torch.isfinite(g).all():
        return float("inf")
    return ((g - r).norm() / r.norm().clamp(min=1e-300)).item()


def check_close(what: str, got: torch.Tensor, ref: torch.Tensor, world: int, dtype: torch.dtype | None = None,
                extra_ulps: float = 0) -> dict:
    """{"<what>_ulps", "<what>_rel_err"} of got against ref; CheckFailed naming both and the limits
    where either is over its limit. `extra_ulps`: roundings the reference makes beyond the all-reduce's
    (GEMM + all-reduce: every rank's partial product rounded before the sum, an ulp of each)."""
    u, e = ulps(got, ref, dtype), rel_err(got, ref)
    out = {f"{what}_ulps": u, f"{what}_rel_err": e}
    limit = ulp_tolerance(world) + extra_ulps
    if not (u <= limit and e <= REL_TOLERANCE):
        raise CheckFailed(f"{what}: {u:.1f} ulps (limit {limit:.0f}), relative error {e:.2e} "
                          f"(limit {REL_TOLERANCE:.0e}) against the reference")
    return out


def agreed(ctx, check) -> dict:
    """Run `check()` (which returns its figures or raises CheckFailed) on every rank, and agree: every
    rank raises CheckFailed, naming each failing rank, where any rank's check failed. A rank that left
    the row alone while its peers went on to time it would hang them in the next collective."""
    import torch.distributed as dist
    try:
        figures, why = check(), None
    except CheckFailed as e:
        figures, why = {}, str(e)
    whys = [None] * ctx.world_size
    dist.all_gather_object(whys, why, group=ctx.group)
    failed = [f"rank {r}: {w}" for r, w in enumerate(whys) if w]
    if failed:
        raise CheckFailed("; ".join(failed))
    return figures
