"""The decode matmul, `gemv`: F.linear for 1..64 rows, by the FMA weight stream (kernels/gemv.py) or the
GEMM core's tiles with the operands swapped (decode_config.py picks per shape), used by the layers where
it beats F.linear; and `gemv_silu_mul`, gate_up_proj with its SiLU-mul in the FMA path's epilogue."""

from __future__ import annotations

import dataclasses

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
    out = _output(out, m, n, x, "gemv")
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
    _launch_fma(x, weight, bias, out, cfg, dependent_launch)
    return out


def gemv_silu_mul_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv_silu_mul takes gate_up_proj's x and weight [2n, K]: the decode matmul's cases, an even
    number of weight rows, and the FMA path in the device's table for [M, K] x [K, 2n] (the tensor-core
    path's tiles hold y^T, where gate and up are rows: it has no such epilogue)."""
    return (gemv_applies(x, weight) and weight.shape[0] % 2 == 0 and x.shape[0] <= FMA_MAX_ROWS
            and pick_decode_config(x.shape[0], weight.shape[0], x.shape[1], x.device).path == "fma")


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                  config: DecodeConfig | None = None, dependent_launch: bool = DEPENDENT_LAUNCH) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for gate_up_proj's weight [2n, K] (gate rows, then up rows) and
    decode-sized x [M, K]: one launch of the FMA path with the activation in its epilogue (kernels/gemv.py,
    SILU_MUL), where the layer would otherwise run the decode matmul and then the SiLU-mul kernel. fp32
    sums, activated, rounded once (as ops.gemm.gemm_silu_mul). `config`: the FMA config of the plain
    [M, K] x [K, 2n] matmul (default: the table's); each program streams as many weight rows as there,
    for half as many output columns."""
    if not gemv_applies(x, weight) or weight.shape[0] % 2 or x.shape[0] > FMA_MAX_ROWS:
        raise ValueError(f"gemv_silu_mul: takes x [M, K] with 1 <= M <= {FMA_MAX_ROWS} (FMA_MAX_ROWS) and gate_up's "
                         f"weight [2n, K] (an even number of rows) of x's 16-bit dtype, both with unit stride along "
                         f"K, on one device; got x{tuple(x.shape)} {x.dtype}, weight{tuple(weight.shape)} "
                         f"{weight.dtype}")
    m, k = x.shape
    n = weight.shape[0] // 2
    out = _output(out, m, n, x, "gemv_silu_mul")
    if n == 0:
        return out
    cfg = config or pick_decode_config(m, 2 * n, k, x.device)
    if cfg.path != "fma":
        raise ValueError(f"gemv_silu_mul: runs the FMA path only, the config is {cfg.label()} "
                         "(gemv_silu_mul_applies says where the table picks the FMA path)")
    stats.record("gemv_silu_mul.kernel")
    _launch_fma(x, weight, None, out, dataclasses.replace(cfg, block_n=max(1, cfg.block_n // 2)),
                dependent_launch, silu_mul=True)
    return out


def _output(out: torch.Tensor | None, m: int, n: int, x: torch.Tensor, op: str) -> torch.Tensor:
    """`out`, checked, or a new [m, n] tensor of x's dtype on x's device."""
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"{op}: out must be [{m}, {n}] {x.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return out


def _launch_fma(x, weight, bias, out, cfg: DecodeConfig, dependent_launch: bool, silu_mul: bool = False) -> None:
    """The FMA path's launch: a program per cfg.block_n output columns (of `out`)."""
    m, k = x.shape
    n = out.shape[1]
    gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x_ptr=x, w_ptr=weight, bias_ptr=bias if bias is not None else x, y_ptr=out, M=m, N=n, K=k,
        stride_xm=x.stride(0), stride_wn=weight.stride(0), stride_ym=out.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **_dependent(dependent_launch, x.device),
        # the FMA chain needs contraction; Triton 3.10 turns it off by default (the interpreter takes no options)
        **({} if x.device.type == "cpu" else {"enable_fp_fusion": True}))


def _dependent(asked: bool, device: torch.device) -> dict:
    """The kernel's PDL constexpr and launch option: on where asked and the device has it. Under the
    interpreter (and on ROCm) the kernel takes the same path with the waits as no-ops, so the peeled first
    tile is tested on the CPU."""
    if not asked:
        return {}
    return {"PDL": True, **({"launch_pdl": True} if triton_compat.dependent_launch(device) else {})}
