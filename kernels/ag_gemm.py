"""All-gather + GEMM: C[M, N] = all_gather(A_shard)[M, K] @ B[K, N], M = W * M_shard.

Peers' shards arrive in `gathered[parity, src]` by copy engine (the host pushes each chunk of
the local shard into every peer's heap and then the epoch into the peer's `flags[src, chunk]`),
so no SM is spent on the transfer. Tiles of the local shard go first and read A straight from the
input; tiles of peer shards follow in rank order after mine, each waiting for its rows' chunks.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma
from tp_overlap_plugin.kernels.gemm import gemm_tile, tile_coords


@triton.jit
def ag_gemm_kernel(a_ptr, gathered_ptr, b_ptr, c_ptr, flags_ptr, epoch_ptr, M_shard, N, K,
                   stride_am, stride_bk, stride_bn, gathered_shard_stride, rank, world, heap_bases, error_ptr, max_spins,
                   CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    epoch = tl.load(epoch_ptr)
    parity = epoch % 2
    chunk_rows = tl.cdiv(M_shard, CHUNKS)
    tiles_m = tl.cdiv(M_shard, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    for t in range(tl.program_id(0), world * per_shard, tl.num_programs(0)):
        shard = (rank + t // per_shard) % world
        pid_m, pid_n = tile_coords(t % per_shard, tiles_m, tiles_n, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if shard == rank:
            a_base = a_ptr
        else:
            last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, M_shard) - 1
            for chunk in range(pid_m * BLOCK_M // chunk_rows, last_row // chunk_rows + 1):
                rma.signal_wait(flags_ptr + shard * CHUNKS + chunk, epoch, rank, shard, heap_bases,
                                error_ptr, max_spins)
            a_base = gathered_ptr + tl.cast(parity * world + shard, tl.int64) * gathered_shard_stride
        acc = gemm_tile(a_base, b_ptr, rows % M_shard, cols % N, K, stride_am, 1, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET)
        out_rows = shard * M_shard + rows
        mask = (rows < M_shard)[:, None] & (cols < N)[None, :]
        tl.store(c_ptr + out_rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=mask)
