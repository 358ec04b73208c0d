"""The decode matmul, `gemv`: F.linear for 1..64 rows, by the FMA weight stream (kernels/gemv.py) or the
GEMM core's tiles with the operands swapped (decode_config.py picks per shape), used by the layers where
it beats F.linear."""

from __future__ import annotations

import torch
import triton

from tp_overlap_plugin import stats
from tp_overlap_plugin.decode_config import (
    FMA_MAX_ROWS,
    MAX_ROWS,
    DecodeConfig,
    pick_decode_config,
)
from tp_overlap_plugin.kernels import triton_compat
from tp_overlap_plugin.kernels.gemv import gemv_kernel
from tp_overlap_plugin.ops.gemm import launch_tiles
from tp_overlap_plugin.ops.operands import KERNEL_DTYPES

GEMV_MAX_ROWS = MAX_ROWS


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The decode matmul's cases: 1..GEMV_MAX_ROWS rows, 16-bit floats alike, unit stride along K."""
    return (x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS and x.shape[1] == weight.shape[1]
            and x.shape[1] > 0 and x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and x.stride(1) == 1
            and weight.stride(1) == 1 and x.device == weight.device)


# Programmatic dependent launch of the FMA path (kernels/gemv.py): the first weight tile read while the
# kernel ahead (the fused all-reduce + norm) still waits for its peers. Off until measured against the
# kernel without it on the decode step (bench/notes/decode.md, "Dependent launch of the GEMV"); tests and
# that measurement pass dependent_launch=True.
DEPENDENT_LAUNCH = False


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, config: DecodeConfig | None = None,
         dependent_launch: bool = DEPENDENT_LAUNCH) -> torch.Tensor:
    """F.linear(x, weight, bias) for decode-sized x ([M, K], M <= GEMV_MAX_ROWS; weight [N, K]): the
    decode matmul. `config` (default: the device's measured table, decode_config.pick_decode_config)
    picks the path: the FMA weight stream (kernels/gemv.py) or the GEMM core's tensor-core tiles with
    the operands swapped (y^T = W @ x^T). fp32 accumulation; the same bits on every call and rank.
    `dependent_launch`: the FMA path with programmatic dependent launch where the device has it (NVIDIA,
    compute capability 9 on; elsewhere the flag changes nothing)."""
    if not gemv_applies(x, weight):
        raise ValueError(f"gemv: takes x [M, K] with 1 <= M <= {GEMV_MAX_ROWS} (GEMV_MAX_ROWS) and a weight [N, K] "
                         f"of x's 16-bit dtype ({', '.join(map(str, KERNEL_DTYPES))}), both with unit stride "
                         f"along K, on one device; got x{tuple(x.shape)} {x.dtype} stride {tuple(x.stride())}, "
                         f"weight{tuple(weight.shape)} {weight.dtype} stride {tuple(weight.stride())}")
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"gemv: bias must be a contiguous [{n}] {x.dtype} tensor, got {tuple(bias.shape)} {bias.dtype}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"gemv: out must be [{m}, {n}] {x.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if n == 0:
        return out
    cfg = config or pick_decode_config(m, n, k, x.device)
    if not cfg.takes(m):
        raise ValueError(f"gemv: config {cfg.label()} does not take {m} rows (the FMA path takes at most "
                         f"{FMA_MAX_ROWS})")
    stats.record("gemv.kernel")
    if cfg.path == "mma":
        # the core's C is y^T: tile rows are weight rows (y's columns), tile columns are x's rows
        launch_tiles(weight, x.t(), out.t(), cfg.tile_config(m))
        if bias is not None:
            out += bias
        return out
    gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x_ptr=x, w_ptr=weight, bias_ptr=bias if bias is not None else x, y_ptr=out, M=m, N=n, K=k,
        stride_xm=x.stride(0), stride_wn=weight.stride(0), stride_ym=out.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_dependent(dependent_launch, x.device),
        # the FMA chain needs contraction; Triton 3.10 turns it off by default (the interpreter takes no options)
        **({} if x.device.type == "cpu" else {"enable_fp_fusion": True}))
    return out


def _dependent(asked: bool, device: torch.device) -> dict:
    """The kernel's PDL constexpr and launch option: on where asked and the device has it. Under the
    interpreter (and on ROCm) the kernel takes the same path with the waits as no-ops, so the peeled first
    tile is tested on the CPU."""
    if not asked:
        return {}
    return {"PDL": True, **({"launch_pdl": True} if triton_compat.dependent_launch(device) else {})}
