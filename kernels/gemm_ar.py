"""GEMM + all-reduce for decode (small M, the replicated layout's row-parallel layers): every rank
holds all M rows of its K-slice, and out = sum over ranks of A_rank @ B_rank (+ bias), the same on
every rank. One launch: the epilogue of each output tile pushes the tile's partial sum straight
into every peer's receive slot, so the reduction of the first tiles overlaps the GEMM of the last.

At M <= 64 the GEMM streams the weight once and computes next to nothing, so what matters is that
enough programs stream it at once: tiles are narrow in N (N / BLOCK_N >= the SM count for hidden
sizes >= 4096, tp_overlap_plugin/gemm_config.py) rather than split in K. Split-K would need the
slices of a tile summed on the sending rank before the push (a workspace round trip and a counter),
and the program that pushes would then be whichever slice finished last, not a fixed one.

The exchange is the one-shot all-reduce's (kernels/all_reduce.py): receive slots hold NOT_YET until
a push overwrites them, pushes are lamport.sendable bits rounded to the dtype (so the sum is the stock
path's: each rank's partial rounded, then summed in fp32 in rank order 0..W-1), the reader resets
what it consumed, and two slots alternate by call parity. The parity is the call's number, kept
in device memory by kernels/calls.py (one counter for the whole op, not one per chunk: the tiling,
and so which program writes an element, changes with M, and every element must change slot from
one call to the next). Why two slots suffice is the all-reduce's argument: a peer cannot finish
call e + 1 without my push of e + 1, which comes after this kernel has ended.

Programs (at most one per SM, so all are resident: a wait never holds up a tile another program
of this rank still has to push) take tiles p, p + P, ... in two passes: first every tile is
multiplied and pushed, its own copy stored into this rank's slot for the second pass; then every
tile waits for its peers' copies, sums, stores. No wait comes before a push, so no rank waits on a
tile that its peer's programs have not reached. A rank whose heap already holds an error pushes
nothing; a wait that gives up (bounded in time: lamport.wait_landed) records rank, peer and address
in the error slot and ends its program's work: the rest of its tiles are NaN.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import calls, rma
from tp_overlap_plugin.kernels.lamport import bits, flag, not_yet, peer_tile, sendable, sum_in_rank_order, wait_landed
from tp_overlap_plugin.kernels.gemm import gemm_tile, store_tile, tile_coords


@triton.jit
def gemm_all_reduce_kernel(a_ptr, b_ptr, bias_ptr, out_ptr, slots_ptr, calls_ptr, M, N, K, stride_am, stride_bk,
                           stride_bn, stride_om, slot_stride, src_stride, row_stride, rank, heap_bases, error_ptr,
                           WORLD: tl.constexpr, PEERS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_M: tl.constexpr,
                           GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
                           HAS_BIAS: tl.constexpr, PEER_STORE: tl.constexpr, POLL_LOAD: tl.constexpr):
    """a: [M, K] (unit column stride), b: [K, N] by strides (an nn.Linear weight transposed: stride_bk
    = 1), out: [M, N]. slots[e % 2][src][row][col] (int bits of the dtype, row_stride per row) in every
    heap receives rank src's partial of out in call e."""
    epoch, live = calls.begin_call(calls_ptr, error_ptr)
    dtype = out_ptr.dtype.element_ty
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    k_blocks = tl.cdiv(K, BLOCK_K)
    P = tl.num_programs(0)
    slot = slots_ptr + tl.cast(epoch % 2, tl.int64) * slot_stride
    mine = slot + tl.cast(rank, tl.int64) * src_stride
    push_rows = tl.where(live, M, 0)  # a rank that has given up pushes nothing
    for t in range(tl.program_id(0), tiles, P):
        pid_m, pid_n = tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = gemm_tile(a_ptr, b_ptr, pid_m, pid_n, M, N, K, 0, k_blocks, stride_am, 1, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET)
        payload = sendable(bits(acc.to(dtype)))
        for q in tl.static_range(1, WORLD):
            there = rma.translate(mine, rank, (rank + q) % WORLD, heap_bases)
            store_tile(there, there, payload, pid_m, pid_n, push_rows, N, row_stride, 1, BLOCK_M, BLOCK_N,
                       CACHE=PEER_STORE)
        store_tile(mine, mine, payload, pid_m, pid_n, M, N, row_stride, 1, BLOCK_M, BLOCK_N)
    tl.debug_barrier()  # my own tiles, stored above, are read back below by other threads
    ok = live
    pcols, srcs = peer_tile(rank, WORLD, PEERS)
    lane = tl.arange(0, SUB_M * BLOCK_N)
    for t in range(tl.program_id(0), tiles, P):
        pid_m, pid_n = tile_coords(t, tiles_m, tiles_n, GROUP_M)
        for r0 in range(0, BLOCK_M, SUB_M):
            if ok & flag(pid_m * BLOCK_M + r0 < M):
                # a receive tile is SUB_M rows of the output tile, flattened, beside every peer's copy
                rows = pid_m * BLOCK_M + r0 + lane // BLOCK_N
                cols = pid_n * BLOCK_N + lane % BLOCK_N
                mask = (rows < M) & (cols < N)
                offs = rows.to(tl.int64) * row_stride + cols
                own = tl.load(mine + offs, mask=mask, other=0)
                ptrs = slot + srcs.to(tl.int64) * src_stride + offs[:, None]
                m = mask[:, None] & (pcols < WORLD - 1)
                tile, landed = wait_landed(ptrs, m, srcs, epoch, rank, heap_bases, error_ptr, POLL_LOAD)
                ok = ok & landed
                if ok:
                    total = sum_in_rank_order(tile, own.to(dtype, bitcast=True).to(tl.float32), rank, WORLD, dtype)
                    if HAS_BIAS:  # after the sum, rounded as the stock path's `all_reduce(y) + bias` is
                        bias = tl.load(bias_ptr + cols, mask=cols < N, other=0).to(tl.float32)
                        total = total.to(dtype).to(tl.float32) + bias
                    store_tile(out_ptr, out_ptr, tl.reshape(total, (SUB_M, BLOCK_N)), (pid_m * BLOCK_M + r0) // SUB_M,
                               pid_n, M, N, stride_om, 1, SUB_M, BLOCK_N)
                    not_yet(ptrs, m)
            if not ok:
                store_tile(out_ptr, out_ptr, tl.full((SUB_M, BLOCK_N), float("nan"), tl.float32),
                           (pid_m * BLOCK_M + r0) // SUB_M, pid_n, M, N, stride_om, 1, SUB_M, BLOCK_N)
    calls.finish_call(calls_ptr, epoch)
