"""GEMM-RS, `GemmReduceScatter`: c_shard = reduce_scatter(a @ b) in one persistent launch
(kernels/gemm_rs.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.gemm_config import TileConfig
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.kernels.gemm_rs import gemm_rs_kernel
from tp_overlap_plugin.ops.operands import check_operands, fused_config, kernel_applies
from tp_overlap_plugin.ops.slots import PeerSlotOp

# GEMM-RS splits each shard's tiles into this many runs, so that my own rows wait only for partials
# stored a run earlier (kernels/gemm_rs.py). Fixed, so the kernel compiles once per world size.
RS_CHUNKS = 2


class GemmReduceScatter(PeerSlotOp):
    """c_shard = reduce_scatter(a @ b): rank r gets rows [r*M/W, (r+1)*M/W) of the sum over ranks,
    in one persistent launch (kernels/gemm_rs.py): peers' rows first, chunk by chunk, stored straight
    into their owners' heaps (every owner at once), and my own rows a chunk behind, whose tiles sum
    the arrived partials in rank order.

    M not divisible by W is padded with zero rows to the next multiple; the padding rows come back
    as zeros at the end of the last rank's shard. Capacity: `max_rows` rows per shard, `n`
    columns. Call state lives in device memory, so calls can be captured in CUDA graphs."""

    NAME, SLOTS, COLS, RUNS_ARG, RUNS = "gemm_rs", "recv", "n", "chunks", RS_CHUNKS

    def __init__(self, heap: SymmetricHeap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16,
                 device_group: dist.ProcessGroup | None = None, chunks: int = RS_CHUNKS):
        super().__init__(heap, max_rows, n, dtype, device_group, chunks)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
        h = self.heap
        check_operands("gemm_rs", a, b, h.device)
        W = h.world_size
        m, k = a.shape
        n = b.shape[1]
        if m % W:
            a = torch.cat([a, a.new_zeros((W - m % W, k))])
        rows = a.shape[0] // W
        fits = rows <= self.max_rows and n == self.n and a.dtype == self.dtype
        if rows == 0 or k == 0 or W == 1 or not fits or not kernel_applies(a):
            stats.record("gemm_rs.fallback")
            return runtime.reduce_scatter(a @ b, self.device_group)
        self.stream_order.before_call(h.device)
        stats.record("gemm_rs.kernel")
        cfg = fused_config(rows, n, k, h.device, config)
        c = torch.empty((rows, n), dtype=a.dtype, device=h.device)
        gemm_rs_kernel[(self.programs,)](
            a_ptr=a, b_ptr=b, c_ptr=c, recv_ptr=self.recv, rows=rows, N=n, K=k, stride_am=a.stride(0),
            stride_bk=b.stride(0), stride_bn=b.stride(1), slot_stride=self.max_rows * n, counts_ptr=self.counts,
            calls_ptr=self.calls, rank=h.rank, heap_bases=h.heap_bases, error_ptr=h.error,
            WORLD=W, CHUNKS=self.chunks, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0, INTERPRET=h.device.type == "cpu", FLATTEN=cfg.flatten,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        h.check_if_free()
        return c
