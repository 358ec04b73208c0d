"""A decode row layer and the RMSNorm after it as one kernel (the replicated layout: o_proj, down):

    new_residual = all_reduce(x @ W_shard^T) [+ bias] + residual
    normed       = weight * rmsnorm(new_residual)

rounded as the stock path is (each rank's partial rounded to the dtype, the partials summed in
rank order 0..W-1 in fp32, the sum rounded, the bias add rounded, the residual add rounded: the new
residual; the normalised row rounded before the weight multiplies), which HeapAllReduceNorm
(kernels/all_reduce_norm.py) reproduces too.

GEMM + all-reduce (kernels/gemm_ar.py) spreads a row over N / BLOCK_N programs, ~128 at hidden 4096,
so no program holds the whole row that the norm needs. Three passes, every program over its own
tiles (p, p + P, ...):
1. multiply each tile and push it into every peer's row slot (gemm_ar.push_tiles);
2. per tile, wait for every peer's copy, sum in rank order (gemm_ar.reduced_rows), + bias,
   + residual: store the new residual, and each row's sum of squares over the tile's columns (fp32)
   into a local receive slot squares[e % 2][row][tile column], marked as the row slots are
   (lamport.py: NOT_YET until written, so the value is its own arrival mark);
3. per tile, wait (lamport.wait_landed, bounded) until every tile column's square sum of its rows
   has landed, sum them in tile order, and normalise the tile, reading back the new residual this
   program stored in pass 2 (it is in L2; a CTA barrier orders the store before the load).
Every program computes a row's rstd from the same values in the same order, so all tiles of a row,
and all ranks, agree bit for bit.

Pass 3 waits on other programs of this rank: the grid is at most one program per SM
(ops/device.resident_programs), so every program is resident and reaches pass 2; none waits on a
program that cannot run. The interpreter runs programs one after another: one program there
(`cross_program_waits`).

The squares slot is read by every program that owns a tile of the row, not by one, so no reader can
put NOT_YET back after its read. Instead a call resets the whole of the other parity's slot
(max_rows x max tile columns, spread over the programs): the call before read it and has ended, the
call after writes it. The whole, not this call's rows: M and the tile width change from call to
call, and a stale value at a later call's (row, tile) would read as landed.

A wait that gives up (its own peers', or a square sum that a failed program never wrote; that
program's report in the error slot ends the others' waits) leaves NaN in both outputs of every
later tile of the program.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import calls
from tp_overlap_plugin.kernels.gemm import tile_coords
from tp_overlap_plugin.kernels.gemm_ar import push_tiles, reduced_rows
from tp_overlap_plugin.kernels.lamport import bits, flag, sendable, wait_landed


@triton.jit
def _nan_block(out_ptr, res_out_ptr, rows, cols, mask, stride_out, stride_res_out, DTYPE: tl.constexpr):
    nan = tl.full(rows.shape, float("nan"), DTYPE)
    tl.store(res_out_ptr + rows.to(tl.int64) * stride_res_out + cols, nan, mask=mask)
    tl.store(out_ptr + rows.to(tl.int64) * stride_out + cols, nan, mask=mask)


@triton.jit
def gemm_all_reduce_rmsnorm_kernel(a_ptr, b_ptr, bias_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, slots_ptr, squares_ptr,
                                   calls_ptr, squares_calls_ptr, M, N, K, stride_am, stride_bk, stride_bn, stride_res, stride_out,
                                   stride_res_out, slot_stride, src_stride, row_stride, squares_parity_stride,
                                   squares_row_stride, eps, rank, heap_bases, error_ptr, WORLD: tl.constexpr,
                                   PEERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr, SUB_M: tl.constexpr, GROUP_M: tl.constexpr,
                                   TILES_N: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
                                   HAS_BIAS: tl.constexpr, PEER_STORE: tl.constexpr, POLL_LOAD: tl.constexpr):
    """a: [M, K] (unit column stride), b: [K, N] by strides (an nn.Linear weight transposed),
    residual, out (normed), res_out (new residual): [M, N] rows; w, bias: [N]. Row slots as
    GEMM + all-reduce's, and shared with it: one call counter (calls_ptr), whose parity picks the
    row slot. squares: int32 bits of fp32, [2 parities, max_rows, squares_row_stride >= TILES_N tile
    columns], NOT_YET at construction; the parity is this kernel's own call count's
    (squares_calls_ptr): GEMM + all-reduce calls advance the shared one between two of these, and
    the reset below needs the calls that use the squares to alternate."""
    epoch, live = calls.begin_call(calls_ptr, error_ptr)
    sq_epoch = calls.call_number(squares_calls_ptr)
    dtype = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    slot = slots_ptr + tl.cast(epoch % 2, tl.int64) * slot_stride
    squares = squares_ptr + (sq_epoch % 2) * squares_parity_stride

    # the other parity, whole, back to NOT_YET for the next call (the module docstring says why)
    stale = squares_ptr + ((sq_epoch + 1) % 2) * squares_parity_stride
    lane = tl.arange(0, SUB_M * BLOCK_N)
    for i in range(pid * (SUB_M * BLOCK_N), squares_parity_stride, P * (SUB_M * BLOCK_N)):
        tl.store(stale + i + lane, tl.full(lane.shape, -1, tl.int32), mask=i + lane < squares_parity_stride)

    push_tiles(a_ptr, b_ptr, slot, M, N, K, stride_am, stride_bk, stride_bn, row_stride, src_stride, rank, heap_bases,
               live, WORLD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, INTERPRET, PEER_STORE)

    ok = live
    sub_rows = tl.arange(0, SUB_M)
    for t in range(pid, tiles, P):
        pid_m, pid_n = tile_coords(t, tiles_m, tiles_n, GROUP_M)
        for r0 in range(0, BLOCK_M, SUB_M):
            if ok & flag(pid_m * BLOCK_M + r0 < M):
                total, rows, cols, mask, landed = reduced_rows(slot, pid_m * BLOCK_M + r0, pid_n * BLOCK_N, M, N,
                                                               src_stride, row_stride, epoch, rank, heap_bases,
                                                               error_ptr, WORLD, PEERS, BLOCK_N, SUB_M, POLL_LOAD,
                                                               dtype)
                ok = ok & landed
                if ok:
                    total = total.to(dtype).to(tl.float32)
                    if HAS_BIAS:
                        bias = tl.load(bias_ptr + cols, mask=cols < N, other=0).to(tl.float32)
                        total = (total + bias).to(dtype).to(tl.float32)
                    res = tl.load(res_ptr + rows.to(tl.int64) * stride_res + cols, mask=mask, other=0)
                    h = (total + res.to(tl.float32)).to(dtype)
                    tl.store(res_out_ptr + rows.to(tl.int64) * stride_res_out + cols, h, mask=mask)
                    hf = tl.where(mask, h.to(tl.float32), 0.0)
                    part = tl.sum(tl.reshape(hf * hf, (SUB_M, BLOCK_N)), axis=1)
                    srows = pid_m * BLOCK_M + r0 + sub_rows
                    # written through on CDNA: the programs that poll it may sit on another XCD's L2
                    tl.store(squares + srows * squares_row_stride + pid_n, sendable(bits(part)), mask=srows < M,
                             cache_modifier=PEER_STORE)
    # the new residual stored above is read back below by other threads of this program
    tl.debug_barrier()

    tile_cols = tl.arange(0, TILES_N)[None, :]
    me = tl.zeros((1, TILES_N), tl.int32) + rank  # whose squares a wait is for, should it give up
    for t in range(pid, tiles, P):
        pid_m, pid_n = tile_coords(t, tiles_m, tiles_n, GROUP_M)
        for r0 in range(0, BLOCK_M, SUB_M):
            rows = pid_m * BLOCK_M + r0 + lane // BLOCK_N
            cols = pid_n * BLOCK_N + lane % BLOCK_N
            mask = (rows < M) & (cols < N)
            if ok & flag(pid_m * BLOCK_M + r0 < M):
                srows = pid_m * BLOCK_M + r0 + sub_rows
                ptrs = squares + srows[:, None] * squares_row_stride + tile_cols
                m = (srows < M)[:, None] & (tile_cols < tiles_n)
                tile, landed = wait_landed(ptrs, m, me, sq_epoch, rank, heap_bases, error_ptr, POLL_LOAD)
                ok = ok & landed
                if ok:
                    sum_sq = tl.sum(tl.where(m, tile.to(tl.float32, bitcast=True), 0.0), axis=1)
                    rstd = 1.0 / tl.sqrt(sum_sq / N + eps)
                    h = tl.load(res_out_ptr + rows.to(tl.int64) * stride_res_out + cols, mask=mask, other=0)
                    h = tl.reshape(h.to(tl.float32), (SUB_M, BLOCK_N))
                    y = tl.reshape((h * rstd[:, None]).to(dtype), (SUB_M * BLOCK_N,)).to(tl.float32)
                    w = tl.load(w_ptr + cols, mask=cols < N, other=0).to(tl.float32)
                    tl.store(out_ptr + rows.to(tl.int64) * stride_out + cols, (y * w).to(dtype), mask=mask)
            if not ok:  # NaN rows, not partial or stale ones
                _nan_block(out_ptr, res_out_ptr, rows, cols, mask, stride_out, stride_res_out, dtype)
    calls.finish_call(squares_calls_ptr, sq_epoch)
    calls.finish_call(calls_ptr, epoch)
