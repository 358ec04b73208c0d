"""GEMM-RS in one persistent launch: rank r's C_shard = rows [r * rows, (r + 1) * rows) of the sum
over ranks of A @ B (each rank holds a K-slice of the product).

Work items are the tiles of A @ B in shard order, peers' rows first: shard s of the walk belongs to
rank (me + 1 + s) mod W, so my own rows come last and every peer's partials for me are computed
before I reach mine (in every rank's walk, mine come before that rank's own). A program takes the
next item from the op's work queue (kernels/work_queue.py).

A tile of a peer's rows is stored straight into that owner's heap, `recv[parity, slot]`
(slot = (src - owner - 1) mod W: W - 1 slots), then its own flag is raised, `flags[slot, tile]`.
A tile of my rows is the reduction: it waits for the W - 1 partials of the same tile and sums all
W in rank order 0..W-1 in fp32, my own rounded to the output dtype first as the peers' were. The
order is fixed, so the result does not depend on arrival order and matches a reference that rounds
each partial. Parity is the call number's (device memory); two halves suffice because a peer can
reach call e + 2, which writes half e % 2 again, only after I finished call e + 1.

The tiles are the one GEMM core's (kernels/gemm.py), by pointer.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma, work_queue
from tp_overlap_plugin.kernels.gemm import gemm_tile, store_tile, tile_coords


@triton.jit
def load_tile(ptr, pid_m, pid_n, M, N, mask_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 copy of tile (pid_m, pid_n) of a row-major [M, N] array; zeros outside it or unless mask_ok."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :] & mask_ok
    return tl.load(ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def gemm_rs_kernel(a_ptr, b_ptr, c_ptr, recv_ptr, rows, N, K, stride_am, stride_bk, stride_bn, slot_stride,
                   flags_ptr, flag_stride, queue_ptr, rank, world, heap_bases, error_ptr, max_spins,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    """c[i] = sum over src of (A_src @ B_src)[rank * rows + i]; a is [world * rows, K] (row stride
    stride_am, unit column stride), c is [rows, N].

    Once this rank has given up on a peer, the program stores nothing into peers' heaps and raises
    no flag (its stream no longer orders those stores after the owner's last read of that half),
    and a tile whose partials did not all arrive is not written."""
    epoch = work_queue.call_number(queue_ptr)
    half = (epoch % 2).to(tl.int64) * (world - 1) * slot_stride
    ok = True  # a bool (the interpreter types a bare comparison as an integer, which no mask takes)
    ok = ok & rma.no_error(error_ptr)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    k_blocks = tl.cdiv(K, BLOCK_K)
    item = work_queue.next_item(queue_ptr)
    while item < world * per_shard:
        shard = item // per_shard
        tile = item % per_shard
        pid_m, pid_n = tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        owner = (rank + 1 + shard) % world
        a = a_ptr + owner.to(tl.int64) * rows * stride_am
        acc = gemm_tile(a, b_ptr, pid_m, pid_n, rows, N, K, 0, k_blocks, stride_am, 1, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET, False, False)
        if owner != rank:
            if ok:
                slot = (rank - owner - 1 + world) % world  # mine, in the owner's heap
                there = rma.translate(recv_ptr + half + slot * slot_stride, rank, owner, heap_bases)
                store_tile(there, there, acc, pid_m, pid_n, rows, N, N, 1, BLOCK_M, BLOCK_N, False, False)
                rma.signal_set(flags_ptr + slot * flag_stride + tile, epoch, rank, owner, heap_bases)
        else:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for src in range(world):
                if src == rank:
                    total += acc.to(c_ptr.dtype.element_ty).to(tl.float32)
                else:
                    slot = (src - rank - 1 + world) % world
                    ok = ok & rma.signal_wait(flags_ptr + slot * flag_stride + tile, epoch, rank, src, heap_bases,
                                              error_ptr, max_spins)
                    total += load_tile(recv_ptr + half + slot * slot_stride, pid_m, pid_n, rows, N, ok,
                                       BLOCK_M, BLOCK_N)
            if ok:
                store_tile(c_ptr, c_ptr, total, pid_m, pid_n, rows, N, N, 1, BLOCK_M, BLOCK_N, False, False)
        item = work_queue.next_item(queue_ptr)
    work_queue.finish_call(queue_ptr, epoch)
