"""The all-reduce of a row-parallel layer's output, the residual add and the RMSNorm after it, as one
kernel (the replicated, decode layout: every rank holds all T rows of the residual).

Decode runs a few microseconds per kernel even in CUDA graphs; this turns the all-reduce kernel
plus the add + norm kernel into one, and the norm reads the sum from registers instead of from
memory. The all-reduce is the one-shot of kernels/all_reduce.py, with rows for chunks: every rank
pushes row r of its partial sum into slot e % 2 of every peer's receive rows (e = this row's epoch
in device memory), then waits for its peers' rows to land (NOT_YET marks what has not), sums them
in rank order in fp32, and puts NOT_YET back. A row that fits one receive tile (`ONE_TILE`: hidden
4096 and 8192 at TP=2, 4096 at TP=4) is normalised from registers, with the weight loaded once per program before any
wait; longer rows are done in column blocks, the norm's sum of squares accumulating over the
blocks, and a second pass reads the new residual back and normalises (one more round trip to
memory, ~0.5 us: bench/notes/allreduce.md).

Rounding follows the stock path (all-reduce, then layer_ops.rmsnorm): the reduced sum is rounded
to the dtype, the bias added and rounded, the residual added and rounded (the new residual), and
the normalised row rounded before the weight multiplies.

A wait that gives up stops the program (see kernels/all_reduce.py): its row, and every later row of
the program, gets NaN in both outputs (the normalised row and the new residual), including blocks
whose sums had landed.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma, triton_compat
from tp_overlap_plugin.kernels.all_reduce import CHUNK_BYTES
from tp_overlap_plugin.kernels.lamport import (advance, bits, flag, not_yet, peer_tile, peers_pow2, sendable,
                                               sum_in_rank_order, tile_elems, wait_landed)




def row_blocks(hidden: int, world: int, elsize: int, threads: int) -> tuple[int, int]:
    """(columns pushed at a time, columns received at a time): a row, or CHUNK_BYTES of it, goes
    out in one piece; it comes in as receive tiles of every peer at once (lamport.tile_elems), the
    whole row if it fits. At 512 threads (16384 elements) a 4096- or 8192-wide row at TP=2 and a
    4096-wide one at TP=4 come in as one tile and are normalised from registers; a 4096 tile made
    an 8192-wide row two tiles and a second pass, +2-4 us at 1-8 rows (bench/notes/allreduce.md)."""
    block = min(triton.next_power_of_2(hidden), CHUNK_BYTES // elsize)
    return block, min(triton.next_power_of_2(hidden), max(tile_elems(threads) // peers_pow2(world), 16))


@triton.jit
def all_reduce_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr, slots_ptr, push_epoch_ptr,
                              row_epoch_ptr, rows, n, stride_x, stride_res, stride_out, stride_res_out, slot_stride,
                              src_stride, row_stride, eps, rank, heap_bases, error_ptr, WORLD: tl.constexpr,
                              PEERS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, ONE_TILE: tl.constexpr,
                              HAS_BIAS: tl.constexpr, PEER_STORE: tl.constexpr, POLL_LOAD: tl.constexpr):
    """slots[e % 2][src][r] in every heap receives rank src's row r in its call e.

    The pushes are spread over the grid a BLOCK of a row at a time, and the rows are received and
    normalised one per program: an 8192-wide row pushed by two programs instead of one took
    0.16-0.25 us less at 1-32 rows (bench/notes/allreduce.md). So a row's pieces may go out from
    other programs than the one that receives it, and each counts its own epoch: piece b of row r in
    push_epochs[r * pieces + b], the row's receiver in row_epochs[r]. All of them count the calls
    that had row r, so they agree, with no program reading another's counter."""
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    dtype = x_ptr.dtype.element_ty
    if ONE_TILE:  # the norm's weight, which no kernel writes: read while the kernel ahead may still run
        w_row = tl.load(w_ptr + tl.arange(0, SUB), mask=tl.arange(0, SUB) < n, other=0).to(tl.float32)
    # Launched with programmatic dependent launch (ops/all_reduce_norm.py), the kernel starts while the
    # kernel ahead of it (the row layer's matmul) finishes; after this wait, what that kernel wrote (x) is
    # visible. The kernel behind (the next layer's matmul) may then start its launch.
    triton_compat.wait_for_previous()
    triton_compat.release_dependents()
    live = flag(rma.no_error(error_ptr))  # a rank that has given up pushes nothing
    pieces = tl.cdiv(n, BLOCK)
    for i in range(pid, rows * pieces, tl.num_programs(0)):
        r = i // pieces
        cols = (i % pieces) * BLOCK + lane
        mask = cols < n
        epoch = advance(push_epoch_ptr + i)
        dst = slots_ptr + (epoch % 2) * slot_stride + rank * src_stride + r * row_stride
        payload = sendable(bits(tl.load(x_ptr + r * stride_x + cols, mask=mask)))
        for q in tl.static_range(1, WORLD):
            peer = (rank + q) % WORLD
            tl.store(rma.translate(dst + cols, rank, peer, heap_bases), payload, mask=mask & live,
                     cache_modifier=PEER_STORE)
    ok = pid >= 0
    pcols, srcs = peer_tile(rank, WORLD, PEERS)
    lane = tl.arange(0, SUB)
    for r in range(pid, rows, tl.num_programs(0)):
        epoch = advance(row_epoch_ptr + r)
        if ok:
            base = slots_ptr + (epoch % 2) * slot_stride + r * row_stride
            squares = tl.zeros((SUB,), dtype=tl.float32)
            for start in range(0, n, SUB):
                if ok:
                    cols = start + lane
                    mask = cols < n
                    mine = sendable(bits(tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0)))
                    res = tl.load(res_ptr + r * stride_res + cols, mask=mask, other=0).to(tl.float32)
                    ptrs = base + srcs * src_stride + cols[:, None]
                    m = mask[:, None] & (pcols < WORLD - 1)
                    tile, landed = wait_landed(ptrs, m, srcs, epoch, rank, heap_bases, error_ptr, POLL_LOAD)
                    ok = ok & landed
                    if ok:
                        total = sum_in_rank_order(tile, mine.to(dtype, bitcast=True).to(tl.float32), rank, WORLD, dtype)
                        total = total.to(dtype).to(tl.float32)
                        if HAS_BIAS:
                            bias = tl.load(bias_ptr + cols, mask=mask, other=0).to(tl.float32)
                            total = (total + bias).to(dtype).to(tl.float32)
                        h = (total + res).to(dtype)
                        tl.store(res_out_ptr + r * stride_res_out + cols, h, mask=mask)
                        hf = tl.where(mask, h.to(tl.float32), 0.0)
                        squares += hf * hf
                        not_yet(ptrs, m)
                        if ONE_TILE:  # the whole row is here, in registers
                            rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / n + eps)
                            y = (hf * rstd).to(dtype).to(tl.float32) * w_row
                            tl.store(out_ptr + r * stride_out + cols, y.to(dtype), mask=mask)
            if ok and not ONE_TILE:
                rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / n + eps)
                # the new residual is read back by the threads that normalise it, after the
                # reduction above (a CTA barrier) has ordered its stores before these loads
                for start in range(0, n, SUB):
                    cols = start + lane
                    mask = cols < n
                    h = tl.load(res_out_ptr + r * stride_res_out + cols, mask=mask, other=0).to(tl.float32)
                    w = tl.load(w_ptr + cols, mask=mask, other=0).to(tl.float32)
                    y = (h * rstd).to(dtype).to(tl.float32) * w
                    tl.store(out_ptr + r * stride_out + cols, y.to(dtype), mask=mask)
        if not ok:  # a NaN row, not a partial or stale one
            nan = tl.full((SUB,), float("nan"), dtype)
            for start in range(0, n, SUB):
                cols = start + lane
                mask = cols < n
                tl.store(res_out_ptr + r * stride_res_out + cols, nan, mask=mask)
                tl.store(out_ptr + r * stride_out + cols, nan, mask=mask)
