"""GEMM + reduce-scatter: C_shard[M_shard, N] = reduce_scatter(A[M, K] @ B[K, N]).

Each rank computes the tiles owned by its peers first (rank+1, rank+2, ...) and stores each,
rounded to the output dtype, straight from registers into the owner's `recv[parity, me]`, then
raises the owner's per-tile flag. Its own shard comes last: for each own tile it waits for the
peers' tiles and sums all partials in rank order 0..W-1 in fp32. The order is fixed and every
partial is rounded the same way, so the result does not depend on arrival order.

Flag slots are (src, tile) at a fixed stride, so a slot has one writer whatever the shape of the
call. recv is double-buffered by epoch parity: a peer can be at most one call ahead of me (it needs my
tiles of its shard to finish), so it never writes the half I am still reading.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma
from tp_overlap_plugin.kernels.gemm import gemm_tile, tile_coords


@triton.jit
def gemm_rs_kernel(a_ptr, b_ptr, c_ptr, recv_ptr, flags_ptr, epoch_ptr, M_shard, N, K,
                   stride_am, stride_bk, stride_bn, flag_stride, rank, world, heap_bases, error_ptr,
                   max_spins, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    # One epoch counter per program: the grid is fixed, so all programs of all ranks count alike
    # and no grid-wide sync is needed to advance it.
    pid = tl.program_id(0)
    epoch = tl.load(epoch_ptr + pid) + 1
    tl.store(epoch_ptr + pid, epoch)
    parity = epoch % 2
    tiles_m = tl.cdiv(M_shard, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    for t in range(pid, world * per_shard, tl.num_programs(0)):
        shard = (rank + 1 + t // per_shard) % world
        tile = t % per_shard
        pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_shard = a_ptr + tl.cast(shard * M_shard, tl.int64) * stride_am
        acc = gemm_tile(a_shard, b_ptr, rows % M_shard, cols % N, K, stride_am, 1, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET)
        partial = acc.to(c_ptr.dtype.element_ty)
        mask = (rows < M_shard)[:, None] & (cols < N)[None, :]
        tile_offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        slot = tl.cast(parity * world, tl.int64) * M_shard * N
        if shard != rank:
            mine_at_owner = rma.translate(recv_ptr + slot + tl.cast(rank, tl.int64) * M_shard * N, rank, shard,
                                          heap_bases)
            tl.store(mine_at_owner + tile_offs, partial, mask=mask)
            rma.signal_set(flags_ptr + rank * flag_stride + tile, epoch, rank, shard, heap_bases)
        else:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for src in range(world):
                if src == rank:
                    total += partial.to(tl.float32)
                else:
                    rma.signal_wait(flags_ptr + src * flag_stride + tile, epoch, rank, src, heap_bases,
                                    error_ptr, max_spins)
                    theirs = recv_ptr + slot + tl.cast(src, tl.int64) * M_shard * N
                    total += tl.load(theirs + tile_offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(c_ptr + tile_offs, total.to(c_ptr.dtype.element_ty), mask=mask)
