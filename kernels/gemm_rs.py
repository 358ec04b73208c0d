"""GEMM-RS in one persistent launch: rank r's C_shard = rows [r * rows, (r + 1) * rows) of the sum
over ranks of A @ B (each rank holds a K-slice of the product).

The GEMM is plain tile loops (each flattened by the compiler into one pipelined loop, see
kernels/ag_gemm.py for why that shape): first the peers' rows, then my own. Each shard's tiles
are split into CHUNKS equal runs of its tile order, and the loops go chunk by chunk: the peers'
loop for chunk c takes chunk c of every peer's shard, rank (me + 1 + s) mod W in turn, so in every
rank's walk my rows come before that rank's own; then my own rows, chunk by chunk.

A tile of a peer's rows is stored straight into that owner's heap, `recv[half, slot]`
(slot = (src - owner - 1) mod W: W - 1 slots); after each chunk's loop a program adds the number
it stored to the owner's `counts[half, slot, chunk]` with a releasing atomic. Before my own rows
of chunk c a program waits until every peer's count for chunk c is the chunk's tile count; each
of my tiles then sums all W partials in rank order 0..W-1 in fp32, my own rounded to the output
dtype first as the peers' were. The order is fixed, so the result does not depend on arrival
order.

Why chunks: the stores of the last tiles of the peers' loop are still on the link when that loop
ends (one 64 KB tile per program: 8 MB on 132 SMs, ~25 us over NVLink on H200). With one chunk
every rank waits for them before any own tile; with two, the tail of chunk 1 drains while my own
chunk 0 computes. Measured on H200 x2: 3% off 70B down (K = 14336), a tie on the 8B shapes, whose
loss is elsewhere (bench/notes/gemm_rs.md, ag_gemm.md).

The half is the call number's parity (device memory): a peer can reach call e + 2, which writes
half e % 2 again, only after I finished call e + 1; the program that finishes call e last zeroes
half e % 2's counts for it.

The tiles are the one GEMM core's (kernels/gemm.py), by pointer.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import calls, rma
from tp_overlap_plugin.kernels.gemm import gemm_tile, store_tile, tile_coords


@triton.jit
def load_tile(ptr, pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 copy of tile (pid_m, pid_n) of a row-major [M, N] array; zeros outside it."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return tl.load(ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _chunk(c, per_shard, CHUNKS: tl.constexpr):
    """(first tile, tile count) of chunk c of a shard's per_shard tiles, in tile order."""
    lo = c * per_shard // CHUNKS
    return lo, (c + 1) * per_shard // CHUNKS - lo


@triton.jit
def gemm_rs_kernel(a_ptr, b_ptr, c_ptr, recv_ptr, rows, N, K, stride_am, stride_bk, stride_bn, slot_stride,
                   counts_ptr, calls_ptr, rank, heap_bases, error_ptr,
                   WORLD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
                   FLATTEN: tl.constexpr):
    """c[i] = sum over src of (A_src @ B_src)[rank * rows + i]; a is [WORLD * rows, K] (row stride
    stride_am, unit column stride), c is [rows, N]. counts: [2, WORLD - 1, CHUNKS].

    Once this rank has given up on a peer, the program stores nothing into peers' heaps and counts
    nothing there (its stream no longer orders those stores after the owner's last read of that
    half), and computes none of its own tiles (their partials may never arrive): they are NaN."""
    epoch, ok = calls.begin_call(calls_ptr, error_ptr)
    half = epoch % 2
    P = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    row_blocks = tl.cdiv(rows, BLOCK_M)
    per_shard = row_blocks * tiles_n
    k_blocks = tl.cdiv(K, BLOCK_K)
    recv_half = recv_ptr + tl.cast(half, tl.int64) * (WORLD - 1) * slot_stride
    counts_half = counts_ptr + half * (WORLD - 1) * CHUNKS
    peers_items = (WORLD - 1) * per_shard
    for c in tl.static_range(CHUNKS):
        lo, size = _chunk(c, per_shard, CHUNKS)
        first = (WORLD - 1) * lo  # this chunk's items: every peer's tiles lo .. lo + size - 1
        end = first + (WORLD - 1) * size
        if not ok:
            end = first
        for item in tl.range(calls.first_item(first, P), end, P, flatten=FLATTEN):
            owner = (rank + 1 + (item - first) // size) % WORLD
            slot = (rank - owner - 1 + WORLD) % WORLD  # mine, in the owner's heap
            pid_m, pid_n = tile_coords(lo + (item - first) % size, row_blocks, tiles_n, GROUP_M)
            acc = gemm_tile(a_ptr + tl.cast(owner, tl.int64) * rows * stride_am, b_ptr, pid_m, pid_n, rows, N, K, 0,
                            k_blocks, stride_am, 1, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET,
                            False, False)
            there = rma.translate(recv_half + tl.cast(slot, tl.int64) * slot_stride, rank, owner, heap_bases)
            store_tile(there, there, acc, pid_m, pid_n, rows, N, N, 1, BLOCK_M, BLOCK_N, False, False)
        # Each owner learns how many of this chunk's tiles this program stored, once, after the loop:
        # an atomic per tile inside it would stop the compiler from flattening it. The barrier puts
        # every thread's stores before the one releasing add (cumulativity).
        tl.debug_barrier()
        for shard in tl.static_range(WORLD - 1):
            if ok:
                owner = (rank + 1 + shard) % WORLD
                slot = (rank - owner - 1 + WORLD) % WORLD
                stored = calls.items_in(first + shard * size, first + (shard + 1) * size, P)
                if stored > 0:
                    tl.atomic_add(rma.translate(counts_half + slot * CHUNKS + c, rank, owner, heap_bases), stored,
                                  sem="release", scope="sys")
    a_mine = a_ptr + tl.cast(rank, tl.int64) * rows * stride_am
    for c in tl.static_range(CHUNKS):
        lo, size = _chunk(c, per_shard, CHUNKS)
        # a chunk's partials were stored a whole chunk of tiles ago (the last one's, a loop ago):
        # the link has drained them while this rank computed
        for peer in tl.static_range(WORLD):
            if peer != rank:
                ok = ok & rma.signal_wait(counts_half + ((peer - rank - 1 + WORLD) % WORLD) * CHUNKS + c,
                                          tl.cast(size, tl.int64), rank, peer, heap_bases, error_ptr)
        first = peers_items + lo
        end = first + size
        if not ok:
            end = first
        for item in tl.range(calls.first_item(first, P), end, P, flatten=FLATTEN):
            pid_m, pid_n = tile_coords(item - peers_items, row_blocks, tiles_n, GROUP_M)
            acc = gemm_tile(a_mine, b_ptr, pid_m, pid_n, rows, N, K, 0, k_blocks, stride_am, 1, stride_bk, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET, False, False)
            mine = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for src in tl.static_range(WORLD):  # no branch in the loop body: it stays one pipelined loop
                slot = (src - rank - 1 + WORLD) % WORLD  # W - 1 for me: no rows loaded
                theirs = load_tile(recv_half + tl.cast(slot, tl.int64) * slot_stride, pid_m, pid_n,
                                   tl.where(src == rank, 0, rows), N, BLOCK_M, BLOCK_N)
                total += tl.where(src == rank, mine, theirs)
            store_tile(c_ptr, c_ptr, total, pid_m, pid_n, rows, N, N, 1, BLOCK_M, BLOCK_N, False, False)
        if not ok:  # rows whose partials may never arrive: NaN, not stale or uninitialised memory
            for item in range(calls.first_item(first, P), first + size, P):
                pid_m, pid_n = tile_coords(item - peers_items, row_blocks, tiles_n, GROUP_M)
                store_tile(c_ptr, c_ptr, tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32), pid_m, pid_n, rows, N,
                           N, 1, BLOCK_M, BLOCK_N, False, False)
    if calls.finish_call(calls_ptr, epoch):
        # every program has passed its waits on this half's counts: zero them for call e + 2
        for s in tl.static_range((WORLD - 1) * CHUNKS):
            tl.store(counts_half + s, 0)
