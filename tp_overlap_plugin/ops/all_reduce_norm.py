"""The all-reduce fused with the residual add and RMSNorm that follow a row-parallel layer in the
replicated (decode) layout, `HeapAllReduceNorm`: one launch (kernels/all_reduce_norm.py) over the heap's
row slots."""

from __future__ import annotations

import torch
import triton

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.all_reduce_norm import (
    all_reduce_rmsnorm_kernel,
    row_blocks,
)
from tp_overlap_plugin.kernels.lamport import peers_pow2
from tp_overlap_plugin.kernels import triton_compat
from tp_overlap_plugin.launch import Launcher
from tp_overlap_plugin.ops.all_reduce import REDUCE_DTYPES
from tp_overlap_plugin.ops.device import cache_modifiers, resident_programs, warp_size
from tp_overlap_plugin.ops.operands import check_apart, like, outputs_overlap
from tp_overlap_plugin.ops.slots import alloc_row_slots, row_slots_bytes

# The fused all-reduce + norm holds a whole row per program (up to 16384 receive elements): 512
# threads (16 warps on NVIDIA, 8 wavefronts on CDNA, so a thread still pushes 16 bytes of a 4096-wide
# block) measured 0.1-0.7 us faster than 256 at hidden 4096-8192, 1-128 rows, a tie at 256 (H200 x2).
NORM_THREADS = 512


def norm_num_warps(warp_size: int) -> int:
    return max(NORM_THREADS // warp_size, 1)


class HeapAllReduceNorm:
    """The all-reduce of a row-parallel layer's partial output fused with what follows it in the
    replicated (decode) layout, one kernel:

        new_residual = all_reduce(x) [+ bias] + residual      (each rounded to the dtype, as the
        normed = weight * rmsnorm(new_residual)                 stock all-reduce + layer_ops.rmsnorm do)

    x, residual: [T, hidden] rows (contiguous rows, any row stride), T <= max_rows. One-shot: every
    rank pushes its rows to every peer (2 * W * max_rows * hidden elements of heap). Collective like
    HeapAllReduce; `dtype` is fixed at construction.
    """

    def __init__(self, heap: SymmetricHeap, hidden: int, max_rows: int, dtype: torch.dtype,
                 dependent_launch: bool | None = None):
        if dtype not in REDUCE_DTYPES:
            raise ValueError(f"all_reduce_rmsnorm dtype must be one of {REDUCE_DTYPES}, got {dtype}")
        if hidden <= 0 or max_rows <= 0:
            raise ValueError(f"all_reduce_rmsnorm needs hidden > 0 and max_rows > 0, got {hidden}, {max_rows}")
        launch_options = self._launch_options(heap.device, dependent_launch)  # (refused before any heap is taken)
        self.heap, self.hidden, self.max_rows, self.dtype = heap, hidden, max_rows, dtype
        self._weight_shape = torch.Size((hidden,))
        W, es = heap.world_size, torch.empty((), dtype=dtype).element_size()
        self.num_warps = norm_num_warps(warp_size(heap.device))
        self.slots = alloc_row_slots(heap, max_rows, hidden, dtype, "all_reduce_norm.slots")
        self.block, self.sub = row_blocks(hidden, W, es, self.num_warps * warp_size(heap.device))
        self.pieces = triton.cdiv(hidden, self.block)  # a row goes out in this many pushes
        self.push_epochs = heap.alloc((max_rows * self.pieces,), torch.int64, name="all_reduce_norm.push_epochs")
        self.row_epochs = heap.alloc((max_rows,), torch.int64, name="all_reduce_norm.row_epochs")
        for t in (self.push_epochs, self.row_epochs):
            t.zero_()
        # a row's pieces may be pushed by another program than the one that waits for them
        self.num_programs = resident_programs(heap.device, cross_program_waits=True)
        self.stream_order = runtime.StreamOrder()
        self.launch = Launcher(
            all_reduce_rmsnorm_kernel, heap.device,
            ("x_ptr", "res_ptr", "w_ptr", "bias_ptr", "out_ptr", "res_out_ptr", "rows", "stride_x", "stride_res",
             "stride_out", "stride_res_out", "eps", "HAS_BIAS"),
            slots_ptr=self.slots, push_epoch_ptr=self.push_epochs, row_epoch_ptr=self.row_epochs, n=hidden,
            slot_stride=self.slots.stride(0), src_stride=self.slots.stride(1), row_stride=self.slots.stride(2),
            rank=heap.rank, heap_bases=heap.heap_bases, error_ptr=heap.error, WORLD=W, PEERS=peers_pow2(W),
            BLOCK=self.block, SUB=self.sub, ONE_TILE=hidden <= self.sub, num_warps=self.num_warps,
            **cache_modifiers(heap.device), **launch_options)
        heap.publish()

    @staticmethod
    def _launch_options(device: torch.device, dependent_launch: bool | None) -> dict:
        """Programmatic dependent launch where the device has it (None: wherever it does): the kernel's
        launch and its first reads overlap the tail of the matmul ahead of it (bench/notes/allreduce.md)."""
        supported = triton_compat.dependent_launch(device)
        if dependent_launch and not supported:
            raise ValueError(f"all_reduce_rmsnorm: dependent_launch=True needs an NVIDIA GPU of compute "
                             f"capability 9 or later; {device} has none")
        return {"launch_pdl": True} if supported and dependent_launch is not False else {}

    @staticmethod
    def heap_bytes(world: int, hidden: int, max_rows: int, dtype: torch.dtype) -> int:
        # the push block does not depend on the receive tile's threads
        block = row_blocks(hidden, world, torch.empty((), dtype=dtype).element_size(), NORM_THREADS)[0]
        epochs = max_rows * (triton.cdiv(hidden, block) + 1)  # push_epochs and row_epochs
        return row_slots_bytes(world, max_rows, hidden, dtype) + 8 * epochs + 3 * 256

    def applies(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.dtype == self.dtype and x.shape[1] == self.hidden and x.shape[0] <= self.max_rows
                and x.stride(1) == 1)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, new_residual): [T, hidden] each, new tensors unless `out` / `residual_out` are
        given (neither may overlap x or residual)."""
        # one expression on the path every valid call takes; the loops that name what is wrong run
        # only when it fails (eager calls are host-bound)
        shape, dt, dev = x.shape, self.dtype, self.heap.device
        if not (self.applies(x) and x.device == dev and like(residual, shape, dt, dev)
                and like(weight, self._weight_shape, dt, dev)
                and (bias is None or like(bias, self._weight_shape, dt, dev))
                and (out is None or like(out, shape, dt, dev))
                and (residual_out is None or like(residual_out, shape, dt, dev))
                and not ((out is not None or residual_out is not None)
                         and outputs_overlap((out, residual_out), (x, residual)))):
            self._raise_bad_call(x, residual, weight, bias, out, residual_out)
        rows = shape[0]
        normed = out if out is not None else torch.empty(shape, dtype=self.dtype, device=dev)
        new_residual = residual_out if residual_out is not None else torch.empty(shape, dtype=self.dtype, device=dev)
        if rows == 0:
            return normed, new_residual
        self.stream_order.before_call(dev)
        stats.record("all_reduce_norm.kernel")
        self.launch(min(rows * self.pieces, self.num_programs), x, residual, weight,
                    bias if bias is not None else weight, normed, new_residual, rows, x.stride(0), residual.stride(0),
                    normed.stride(0), new_residual.stride(0), eps, bias is not None)
        self.heap.check_if_free()
        return normed, new_residual

    def _raise_bad_call(self, x, residual, weight, bias, out, residual_out) -> None:
        if not self.applies(x):
            raise ValueError(f"all_reduce_rmsnorm takes [T <= {self.max_rows}, {self.hidden}] {self.dtype} rows with "
                             f"unit column stride; got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
        for name, t, shape in (("residual", residual, tuple(x.shape)), ("weight", weight, (self.hidden,)),
                               ("bias", bias, (self.hidden,)), ("out", out, tuple(x.shape)),
                               ("residual_out", residual_out, tuple(x.shape))):
            if t is None:
                continue
            if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device or t.stride(-1) != 1:
                raise ValueError(f"all_reduce_rmsnorm {name} must be a {x.dtype} tensor of shape {shape} on "
                                 f"{x.device} with unit last stride; got {t.dtype} {tuple(t.shape)} on {t.device}, "
                                 f"strides {t.stride()}")
        if x.device != self.heap.device:
            raise ValueError(f"all_reduce_rmsnorm input is on {x.device}, but the heap is on {self.heap.device}")
        # the kernel stores rows while later rows (and peers' pushes of them) are still read
        check_apart("all_reduce_rmsnorm", {"out": out, "residual_out": residual_out}, {"x": x, "residual": residual},
                    "the kernel writes a row's outputs while it still reads the inputs")
        raise AssertionError("all_reduce_rmsnorm: a call failed its checks, and none says why")
