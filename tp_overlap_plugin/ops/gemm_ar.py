"""GEMM + all-reduce, `GemmAllReduce`: all_reduce(x @ weight.T) [+ bias] for decode-sized row-parallel
layers in the replicated layout, one launch (kernels/gemm_ar.py) whose tile epilogue pushes every tile
into the peers' row slots."""

from __future__ import annotations

import torch

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.gemm_config import TileConfig, gemm_all_reduce_config
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.gemm_ar import gemm_all_reduce_kernel
from tp_overlap_plugin.kernels.lamport import peers_pow2, tile_elems
from tp_overlap_plugin.launch import Launcher
from tp_overlap_plugin.ops.device import cache_modifiers, resident_programs, warp_size
from tp_overlap_plugin.ops.operands import KERNEL_DTYPES
from tp_overlap_plugin.ops.slots import alloc_row_slots, row_slots_bytes

# GEMM + all-reduce's arguments that change from call to call (the rest is bound per op: launch.py)
_GEMM_AR_VARYING = ("a_ptr", "b_ptr", "bias_ptr", "out_ptr", "M", "K", "stride_am", "stride_bk", "stride_bn", "stride_om",
                    "BLOCK_M", "BLOCK_N", "BLOCK_K", "SUB_M", "GROUP_M", "EVEN_K", "HAS_BIAS")


class GemmAllReduce:
    """out = all_reduce(x @ weight.T) [+ bias], for the replicated (decode) layout's row-parallel layers:
    every rank holds all M rows of its K-slice of x and the matching columns of the nn.Linear weight
    ([n, k]); every rank gets the same sum (fp32, rank order 0..W-1, each rank's partial rounded to
    the dtype first, as F.linear + the all-reduce give). One launch (kernels/gemm_ar.py): the GEMM's
    tile epilogue pushes each tile into every peer's receive slot.

    Capacity is fixed at construction (heap space is symmetric): up to `max_rows` rows of `n`
    columns in `dtype`; receive slots take 2 * W * max_rows * n elements of heap (heap_bytes). Call
    state lives in device memory, so calls can be captured in CUDA graphs. Collective: every rank
    calls it with the same shapes, in the same order. Errors of a wait surface at heap.check()."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16):
        if max_rows < 1 or n < 1:
            raise ValueError(f"GemmAllReduce needs max_rows, n >= 1; got {max_rows}, {n}")
        if dtype not in KERNEL_DTYPES:
            raise ValueError(f"GemmAllReduce dtype must be one of {KERNEL_DTYPES}, got {dtype}")
        self.heap, self.max_rows, self.n, self.dtype = heap, max_rows, n, dtype
        self.slots = alloc_row_slots(heap, max_rows, n, dtype, "gemm_ar.slots")
        self.calls = torch.zeros(2, dtype=torch.int64, device=heap.device)  # kernels/calls.py
        self.programs = resident_programs(heap.device)
        self.cache_modifiers = cache_modifiers(heap.device)
        self.warp_size = warp_size(heap.device)
        self._launchers: dict = {}  # per (num_warps, num_stages): launch.Launcher
        self.stream_order = runtime.StreamOrder()
        heap.publish()

    @staticmethod
    def heap_bytes(world: int, max_rows: int, n: int, dtype: torch.dtype) -> int:
        return row_slots_bytes(world, max_rows, n, dtype) + 256

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether __call__ takes these operands (else it raises)."""
        return (x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype == self.dtype
                and x.shape[0] <= self.max_rows and tuple(weight.shape) == (self.n, x.shape[1])
                and x.stride(1) == 1 and x.device == weight.device == self.heap.device)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, config: TileConfig | None = None) -> torch.Tensor:
        h = self.heap
        if x.dim() != 2 or weight.dim() != 2:
            raise ValueError(f"gemm_all_reduce: expected 2-D x and weight, got x{tuple(x.shape)} and "
                             f"weight{tuple(weight.shape)}")
        m, k = x.shape
        if m > self.max_rows:
            raise ValueError(f"gemm_all_reduce of M={m} rows exceeds max_rows={self.max_rows} (its receive slots "
                             f"take 2 * world * max_rows * n elements of heap); build GemmAllReduce with a larger "
                             f"max_rows or use F.linear + the all-reduce")
        if x.dtype != self.dtype or weight.dtype != self.dtype:
            raise ValueError(f"gemm_all_reduce was built for {self.dtype}; got x {x.dtype}, weight {weight.dtype}")
        if tuple(weight.shape) != (self.n, k):
            raise ValueError(f"gemm_all_reduce weight must be [n={self.n}, k={k}] (an nn.Linear weight for "
                             f"x{tuple(x.shape)}); got {tuple(weight.shape)}")
        if x.stride(1) != 1:
            raise ValueError(f"gemm_all_reduce x needs unit column stride; got strides {x.stride()}")
        for name, t, shape in (("bias", bias, (self.n,)), ("out", out, (m, self.n))):
            if t is not None and (tuple(t.shape) != shape or t.dtype != self.dtype or t.stride(-1) != 1):
                raise ValueError(f"gemm_all_reduce {name} must be a {self.dtype} tensor of shape {shape} with unit "
                                 f"last stride; got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
        for name, t in (("x", x), ("weight", weight), ("bias", bias), ("out", out)):
            if t is not None and t.device != h.device:
                raise ValueError(f"gemm_all_reduce {name} is on {t.device}, but the heap is on {h.device}")
        if out is None:
            out = torch.empty((m, self.n), dtype=self.dtype, device=h.device)
        if m == 0:
            return out
        self.stream_order.before_call(h.device)
        stats.record("gemm_all_reduce.kernel")
        W = h.world_size
        cfg = config or gemm_all_reduce_config(m, self.n, self.programs, h.device)
        tiles = -(-m // cfg.block_m) * -(-self.n // cfg.block_n)
        peers = peers_pow2(W)
        sub_m = max(1, min(cfg.block_m, tile_elems(cfg.num_warps * self.warp_size) // (cfg.block_n * peers)))
        launch = self._launchers.get((cfg.num_warps, cfg.num_stages))
        if launch is None:
            launch = self._launchers[(cfg.num_warps, cfg.num_stages)] = Launcher(
                gemm_all_reduce_kernel, h.device, _GEMM_AR_VARYING, N=self.n, slots_ptr=self.slots,
                calls_ptr=self.calls, slot_stride=self.slots.stride(0), src_stride=self.slots.stride(1),
                row_stride=self.slots.stride(2), rank=h.rank, heap_bases=h.heap_bases, error_ptr=h.error, WORLD=W,
                PEERS=peers, INTERPRET=h.device.type == "cpu", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **self.cache_modifiers)
        launch(min(tiles, self.programs), x, weight, bias if bias is not None else out, out, m, k, x.stride(0),
               weight.stride(1), weight.stride(0), out.stride(0), cfg.block_m, cfg.block_n, cfg.block_k, sub_m,
               cfg.group_m, k % cfg.block_k == 0, bias is not None)
        h.check_if_free()
        return out
