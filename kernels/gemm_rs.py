"""GEMM-RS in one persistent launch: rank r's C_shard = rows [r * rows, (r + 1) * rows) of the sum
over ranks of A @ B (each rank holds a K-slice of the product).

The GEMM is plain tile loops (each flattened by the compiler into one pipelined loop, see
kernels/ag_gemm.py for why that shape). Each shard's tiles are split into CHUNKS equal runs of its
tile order. The peers' loop for chunk c takes chunk c of every peer's shard, the owners interleaved
(consecutive items belong to rank + 1, rank + 2, ...), so the programs running at any moment
store into every peer at once and every link of a full mesh is busy from the first tile; in every
rank's walk my rows come before that rank's own. My own rows of chunk c run after the peers' loop
of chunk c + 1 (P0 P1 O0 P2 O1 ... O(C-1)): by then the partials of chunk c were stored a whole
chunk of tiles ago and have drained, and the link keeps carrying chunk c + 1's while my rows
compute.

A tile of a peer's rows is stored straight into that owner's heap, `recv[half, slot]`
(slot = (src - owner - 1) mod W: W - 1 slots); after each chunk's loop a program adds the number
it stored for each owner to that owner's `counts[half, slot, chunk]` with a releasing atomic.
Before my own rows of chunk c a program waits until every peer's count for chunk c is the chunk's
tile count; each of my tiles then sums all W partials in rank order 0..W-1 in fp32, my own rounded
to the output dtype first as the peers' were. The order is fixed, so the result does not depend on
arrival order, and every rank rounds alike. That sum is the reduction: per own tile it reads the
W - 1 partials from local memory after its K loop (bench/notes/gemm_rs.md: its cost against its
floor).

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
def _peers_chunk(c, ok, a_ptr, b_ptr, recv_half, counts_half, rows, N, K, stride_am, stride_bk, stride_bn,
                 slot_stride, per_shard, row_blocks, tiles_n, k_blocks, rank, heap_bases,
                 WORLD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
                 FLATTEN: tl.constexpr):
    """Chunk c of every peer's rows, stored into the owners' heaps, then counted there. Item
    first + i is tile lo + i // (W - 1) of owner (me + 1 + i mod (W - 1)). Once this rank has given
    up (not ok), nothing: its stream no longer orders these stores after the owner's last read."""
    P = tl.num_programs(0)
    lo, size = _chunk(c, per_shard, CHUNKS)
    first = (WORLD - 1) * lo
    end = first + (WORLD - 1) * size
    if not ok:
        end = first
    for item in tl.range(calls.first_item(first, P), end, P, flatten=FLATTEN):
        j = (item - first) % (WORLD - 1)
        owner = (rank + 1 + j) % WORLD
        pid_m, pid_n = tile_coords(lo + (item - first) // (WORLD - 1), row_blocks, tiles_n, GROUP_M)
        acc = gemm_tile(a_ptr + tl.cast(owner, tl.int64) * rows * stride_am, b_ptr, pid_m, pid_n, rows, N, K, 0,
                        k_blocks, stride_am, 1, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET)
        # mine in the owner's heap: slot (me - owner - 1) mod W = W - 2 - j
        there = rma.translate(recv_half + tl.cast(WORLD - 2 - j, tl.int64) * slot_stride, rank, owner, heap_bases)
        store_tile(there, there, acc, pid_m, pid_n, rows, N, N, 1, BLOCK_M, BLOCK_N)
    # Each owner learns how many of this chunk's tiles this program stored for it, once, after the
    # loop: an atomic per tile inside it would stop the compiler from flattening it. The barrier
    # puts every thread's stores before the releasing adds (cumulativity).
    tl.debug_barrier()
    if ok:
        for j in tl.static_range(WORLD - 1):
            stored = 0
            for item in range(calls.first_item(first, P), end, P):
                stored += ((item - first) % (WORLD - 1) == j).to(tl.int32)
            if stored > 0:
                tl.atomic_add(rma.translate(counts_half + (WORLD - 2 - j) * CHUNKS + c, rank, (rank + 1 + j) % WORLD,
                                            heap_bases), stored, sem="release", scope="sys")


@triton.jit
def _own_chunk(c, ok, a_mine, b_ptr, c_ptr, recv_half, counts_half, rows, N, K, stride_am, stride_bk, stride_bn,
               slot_stride, per_shard, row_blocks, tiles_n, k_blocks, rank, heap_bases, error_ptr,
               WORLD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
               FLATTEN: tl.constexpr):
    """Chunk c of my own rows: wait for every peer's partials of it, then each tile is my partial
    plus theirs, summed in rank order. Returns ok, false once a wait has given up (those tiles NaN)."""
    P = tl.num_programs(0)
    lo, size = _chunk(c, per_shard, CHUNKS)
    first = (WORLD - 1) * per_shard + lo  # numbered after all the peers' items
    if calls.first_item(first, P) < first + size:  # a program with tiles here waits (some program does)
        for j in tl.static_range(WORLD - 1):  # slot j of my heap is written by rank me + 1 + j
            ok = ok & rma.signal_wait(counts_half + j * CHUNKS + c, tl.cast(size, tl.int64), rank,
                                      (rank + 1 + j) % WORLD, heap_bases, error_ptr)
    end = first + size
    if not ok:
        end = first
    for item in tl.range(calls.first_item(first, P), end, P, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(item - first + lo, row_blocks, tiles_n, GROUP_M)
        acc = gemm_tile(a_mine, b_ptr, pid_m, pid_n, rows, N, K, 0, k_blocks, stride_am, 1, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET)
        mine = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for src in tl.static_range(WORLD):  # no branch in the loop body: it stays one pipelined loop
            slot = (src - rank - 1 + WORLD) % WORLD  # W - 1 for me: no rows loaded
            theirs = load_tile(recv_half + tl.cast(slot, tl.int64) * slot_stride, pid_m, pid_n,
                               tl.where(src == rank, 0, rows), N, BLOCK_M, BLOCK_N)
            total += tl.where(src == rank, mine, theirs)
        store_tile(c_ptr, c_ptr, total, pid_m, pid_n, rows, N, N, 1, BLOCK_M, BLOCK_N)
    if not ok:  # rows whose partials may never arrive: NaN, not stale or uninitialised memory
        for item in range(calls.first_item(first, P), first + size, P):
            pid_m, pid_n = tile_coords(item - first + lo, row_blocks, tiles_n, GROUP_M)
            store_tile(c_ptr, c_ptr, tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32), pid_m, pid_n, rows, N,
                       N, 1, BLOCK_M, BLOCK_N)
    return ok


@triton.jit
def gemm_rs_kernel(a_ptr, b_ptr, c_ptr, recv_ptr, rows, N, K, stride_am, stride_bk, stride_bn, slot_stride,
                   counts_ptr, calls_ptr, rank, heap_bases, error_ptr,
                   WORLD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
                   FLATTEN: tl.constexpr):
    """c[i] = sum over src of (A_src @ B_src)[rank * rows + i]; a is [WORLD * rows, K] (row stride
    stride_am, unit column stride), c is [rows, N]. recv: [2, WORLD - 1, max_rows, N]
    (slot_stride = max_rows * N); counts: [2, WORLD - 1, CHUNKS].

    Once this rank has given up on a peer, the program stores nothing into peers' heaps and counts
    nothing there, and computes none of its own tiles (their partials may never arrive): they are NaN."""
    epoch, ok = calls.begin_call(calls_ptr, error_ptr)
    half = epoch % 2
    tiles_n = tl.cdiv(N, BLOCK_N)
    row_blocks = tl.cdiv(rows, BLOCK_M)
    per_shard = row_blocks * tiles_n
    k_blocks = tl.cdiv(K, BLOCK_K)
    recv_half = recv_ptr + tl.cast(half, tl.int64) * (WORLD - 1) * slot_stride
    counts_half = counts_ptr + half * (WORLD - 1) * CHUNKS
    a_mine = a_ptr + tl.cast(rank, tl.int64) * rows * stride_am
    for c in tl.static_range(CHUNKS):
        _peers_chunk(c, ok, a_ptr, b_ptr, recv_half, counts_half, rows, N, K, stride_am, stride_bk, stride_bn,
                     slot_stride, per_shard, row_blocks, tiles_n, k_blocks, rank, heap_bases, WORLD, CHUNKS,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, INTERPRET, FLATTEN)
        if c > 0:
            ok = _own_chunk(c - 1, ok, a_mine, b_ptr, c_ptr, recv_half, counts_half, rows, N, K, stride_am, stride_bk,
                            stride_bn, slot_stride, per_shard, row_blocks, tiles_n, k_blocks, rank, heap_bases,
                            error_ptr, WORLD, CHUNKS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, INTERPRET, FLATTEN)
    ok = _own_chunk(CHUNKS - 1, ok, a_mine, b_ptr, c_ptr, recv_half, counts_half, rows, N, K, stride_am, stride_bk,
                    stride_bn, slot_stride, per_shard, row_blocks, tiles_n, k_blocks, rank, heap_bases, error_ptr,
                    WORLD, CHUNKS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, INTERPRET, FLATTEN)
    if calls.finish_call(calls_ptr, epoch):
        # every program has passed its waits on this half's counts: zero them for call e + 2
        for s in tl.static_range((WORLD - 1) * CHUNKS):
            tl.store(counts_half + s, 0)
