"""A decode row layer and the RMSNorm after it in one launch, `GemmAllReduceNorm`: GEMM + all-reduce
(ops/gemm_ar.py) whose second pass also adds the bias and the residual and normalises
(kernels/gemm_ar_norm.py). It runs on a GemmAllReduce's row slots and call counter, so it costs no
heap of its own: the two kernels are calls of one op in stream order, and the slots' parity keeps
alternating whichever of them runs."""

from __future__ import annotations

import torch
import triton

from tp_overlap_plugin import stats
from tp_overlap_plugin.gemm_config import TileConfig, gemm_all_reduce_config
from tp_overlap_plugin.kernels.gemm_ar_norm import gemm_all_reduce_rmsnorm_kernel
from tp_overlap_plugin.kernels.lamport import peers_pow2
from tp_overlap_plugin.launch import Launcher
from tp_overlap_plugin.ops.device import resident_programs
from tp_overlap_plugin.ops.gemm_ar import GemmAllReduce
from tp_overlap_plugin.ops.operands import check_apart, like, outputs_overlap

# the narrowest tile GEMM + all-reduce takes (tl.dot's 16 columns): the squares slot has a column per
# tile of a row, cdiv(n, MIN_BLOCK_N) of them
MIN_BLOCK_N = 16

_VARYING = ("a_ptr", "b_ptr", "bias_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr", "M", "K", "stride_am",
            "stride_bk", "stride_bn", "stride_res", "stride_out", "stride_res_out", "eps", "BLOCK_M", "BLOCK_N",
            "BLOCK_K", "SUB_M", "GROUP_M", "TILES_N", "EVEN_K", "HAS_BIAS")


class GemmAllReduceNorm:
    """(normed, new_residual) of a row-parallel layer in the replicated (decode) layout and the
    RMSNorm after it:

        new_residual = all_reduce(x @ weight.T) [+ bias] + residual
        normed = norm_weight * rmsnorm(new_residual)

    rounded as F.linear, the stock all-reduce and layer_ops.rmsnorm round (each rank's partial to the
    dtype, summed in fp32 in rank order 0..W-1, then each add). x: [M <= max_rows, k] with unit column
    stride, weight: [n, k] (nn.Linear), residual: [M, n] rows. Collective like GemmAllReduce, whose
    slots and call counter it uses (`gemm_ar`). Errors of a wait surface at heap.check()."""

    def __init__(self, gemm_ar: GemmAllReduce):
        h = gemm_ar.heap
        self.gemm_ar, self.heap, self.n, self.dtype, self.max_rows = gemm_ar, h, gemm_ar.n, gemm_ar.dtype, gemm_ar.max_rows
        self.max_tiles = triton.cdiv(self.n, MIN_BLOCK_N)
        # local (no peer writes it): each row's sum of squares per tile column, int32 bits of fp32,
        # NOT_YET (-1) until written; two parities by this op's own call count
        self.squares = torch.full((2, self.max_rows, self.max_tiles), -1, dtype=torch.int32, device=h.device)
        self.calls = torch.zeros(2, dtype=torch.int64, device=h.device)  # kernels/calls.py
        # pass 3 waits on other programs of this rank: all resident, one under the interpreter
        self.programs = resident_programs(h.device, cross_program_waits=True)
        self._vector = torch.Size((self.n,))
        self._launchers: dict = {}  # per (num_warps, num_stages)

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.gemm_ar.applies(x, weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None,
                 config: TileConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, new_residual), [M, n] each: new tensors unless `out` / `residual_out` are given
        (neither may overlap x or residual: the kernel stores tiles while others are still read)."""
        dt, dev, n = self.dtype, self.heap.device, self.n
        # one expression on the path every valid call takes (eager calls are host-bound); the
        # checks that name what is wrong run only when it fails
        m = x.shape[0] if x.dim() == 2 else -1
        rows = (m, n)
        if not (self.gemm_ar.applies(x, weight) and like(residual, rows, dt, dev)
                and like(norm_weight, self._vector, dt, dev) and (bias is None or like(bias, self._vector, dt, dev))
                and (out is None or like(out, rows, dt, dev)) and (residual_out is None or like(residual_out, rows, dt, dev))
                and not ((out is not None or residual_out is not None)
                         and outputs_overlap((out, residual_out), (x, residual)))):
            self._raise_bad_call(x, weight, residual, norm_weight, bias, out, residual_out)
        normed = out if out is not None else torch.empty(rows, dtype=dt, device=dev)
        new_residual = residual_out if residual_out is not None else torch.empty(rows, dtype=dt, device=dev)
        if m == 0:
            return normed, new_residual
        g = self.gemm_ar
        cfg = config or gemm_all_reduce_config(m, n, g.programs, dev)
        tiles_n = triton.cdiv(n, cfg.block_n)
        if cfg.block_n < MIN_BLOCK_N:
            raise ValueError(f"gemm_all_reduce_rmsnorm tiles must be >= {MIN_BLOCK_N} columns wide (its squares slot "
                             f"has a column per tile); got BLOCK_N={cfg.block_n}")
        g.stream_order.before_call(dev)
        stats.record("gemm_all_reduce_norm.kernel")
        W = self.heap.world_size
        tiles = triton.cdiv(m, cfg.block_m) * tiles_n
        sub_m = g.sub_rows(cfg)
        launch = self._launchers.get((cfg.num_warps, cfg.num_stages))
        if launch is None:
            launch = self._launchers[(cfg.num_warps, cfg.num_stages)] = Launcher(
                gemm_all_reduce_rmsnorm_kernel, dev, _VARYING, N=n, slots_ptr=g.slots, squares_ptr=self.squares,
                calls_ptr=g.calls, squares_calls_ptr=self.calls, slot_stride=g.slots.stride(0),
                src_stride=g.slots.stride(1), row_stride=g.slots.stride(2), squares_parity_stride=self.squares.stride(0),
                squares_row_stride=self.squares.stride(1), rank=self.heap.rank, heap_bases=self.heap.heap_bases,
                error_ptr=self.heap.error, WORLD=W, PEERS=peers_pow2(W), INTERPRET=dev.type == "cpu",
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **g.cache_modifiers)
        launch(min(tiles, self.programs), x, weight, bias if bias is not None else norm_weight, residual, norm_weight,
               normed, new_residual, m, x.shape[1], x.stride(0), weight.stride(1), weight.stride(0), residual.stride(0),
               normed.stride(0), new_residual.stride(0), eps, cfg.block_m, cfg.block_n, cfg.block_k, sub_m,
               cfg.group_m, triton.next_power_of_2(tiles_n), x.shape[1] % cfg.block_k == 0, bias is not None)
        self.heap.check_if_free()
        return normed, new_residual

    def _raise_bad_call(self, x, weight, residual, norm_weight, bias, out, residual_out) -> None:
        if not self.gemm_ar.applies(x, weight):
            self.gemm_ar.check(x, weight)  # names what it refuses
            raise ValueError(f"gemm_all_reduce_rmsnorm does not take x {x.dtype} {tuple(x.shape)} strides "
                             f"{x.stride()} on {x.device} with weight {weight.dtype} {tuple(weight.shape)} on "
                             f"{weight.device}")
        rows = (x.shape[0], self.n)
        for name, t, shape in (("residual", residual, rows), ("norm_weight", norm_weight, (self.n,)),
                               ("bias", bias, (self.n,)), ("out", out, rows), ("residual_out", residual_out, rows)):
            if t is not None and not like(t, torch.Size(shape), self.dtype, self.heap.device):
                raise ValueError(f"gemm_all_reduce_rmsnorm {name} must be a {self.dtype} tensor of shape {shape} on "
                                 f"{self.heap.device} with unit last stride; got {t.dtype} {tuple(t.shape)} on "
                                 f"{t.device}, strides {t.stride()}")
        check_apart("gemm_all_reduce_rmsnorm", {"out": out, "residual_out": residual_out},
                    {"x": x, "residual": residual}, "the kernel writes tiles of its outputs while others still read the inputs")
        raise AssertionError("gemm_all_reduce_rmsnorm: a call failed its checks, and none says why")
