"""AG-GEMM in one persistent launch: C = all_gather(A_shard) @ B, the gather hidden behind the GEMM.

The push: the launch's first `pushers` programs store my shard into every peer's heap with vector
stores, one piece of PIECE_ROWS rows at a time, the peers interleaved: piece i goes to rank + 1,
rank + 2, ... before piece i + 1 goes anywhere, and the pushers take consecutive (piece, peer)
units, so every link of a full mesh (NVLink all-to-all, MI300X's XGMI) carries a piece at once and
each rank receives from all of its peers at once. After each piece the pusher adds 1 to my
counter for that piece's segment in the peer's heap (releasing, system scope). Then the pushers
join the GEMM. Nothing is queued on the host per peer: a call is one launch at any world size.
(The copy engine, the previous producer, ran each peer's copies one after another on one stream:
at W = 4 one link of three was busy at a time; bench/notes/ag_gemm.md.)

The GEMM is plain tile loops, each of which the compiler flattens into one pipelined loop (the next
tile's loads in flight during this tile's epilogue: 10-18% of the GEMM's time on H200,
bench/results/fused-core-h200-2026-11-22): my own rows, which need nothing, by the programs that
do not push; then the peers' rows in SEGMENTS runs of row blocks, all programs, each run after
one wait per peer for that run's pieces. A wait inside a loop would end its flattening (measured:
1.15-1.3x cuBLAS against 1.03-1.07x), so the waits sit between the loops; with several segments
the first peers' row blocks are multiplied while the last ones are still on the link (the case
where the link, not the GEMM, is the floor: narrow N, as qkv at TP = 4).

Buffers in the heap, per op: `gathered[half, slot]` holds the rows of the peer whose slot it is
(slot = (src - me - 1) mod W: W - 1 slots) for the calls of that parity; `counts[half, slot, s]`
counts the pieces of segment s that rank src has pushed (src's pushers are its only writers).
The half is the call number's parity (device memory). A push of call e into half e % 2 of a peer
never lands on rows the peer may still read: the peer read half e % 2 in its call e - 2, and this
rank reached call e only after its call e - 1 took that peer's call e - 1 pieces, which the peer
pushed after its call e - 2 had ended (stream order). A rank that has given up on a peer (its
error slot set) pushes nothing any more: then that acknowledgement may be missing. So no seqlock
is needed, and the copy engine's host-side gate is gone. The program that finishes a call last
zeroes its half's counts for call e + 2.

Once this rank has given up, its peers' rows of C are NaN, never stale or unwritten; my own rows
are still computed (they need no peer). The tiles are the one GEMM core's (kernels/gemm.py), by
pointer: rows a peer delivers are read with ordinary loads, which the counter's acquire orders.

Progress needs no co-residency of this rank's programs: pushers never wait, and a waiting program
waits only for peers' pushers, which are the lowest program ids (scheduled first).
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import calls, rma
from tp_overlap_plugin.kernels.gemm import gemm_tile, store_tile, tile_coords


@triton.jit
def _push_shard(a_ptr, gathered_half, counts_half, rows, K, slot_stride, seg_rows, pusher, pushers, rank, heap_bases,
                WORLD: tl.constexpr, SEGMENTS: tl.constexpr, PIECE_ROWS: tl.constexpr, PUSH_COLS: tl.constexpr):
    """Pusher `pusher` of `pushers`: units pusher, pusher + pushers, ... of the (piece, peer) units,
    piece-major. a is my shard, [rows, K] contiguous; the peer's slot has the same row stride."""
    r = tl.arange(0, PIECE_ROWS)
    cols = tl.arange(0, PUSH_COLS)
    for unit in range(pusher, tl.cdiv(rows, PIECE_ROWS) * (WORLD - 1), pushers):
        piece = unit // (WORLD - 1)
        j = unit % (WORLD - 1)
        dst = (rank + 1 + j) % WORLD
        slot = WORLD - 2 - j  # mine in dst's heap: (rank - dst - 1) mod W
        row = (piece * PIECE_ROWS + r).to(tl.int64)
        there = rma.translate(gathered_half + tl.cast(slot, tl.int64) * slot_stride, rank, dst, heap_bases)
        for c0 in range(0, K, PUSH_COLS):
            offs = row[:, None] * K + (c0 + cols)[None, :]
            mask = (row < rows)[:, None] & ((c0 + cols) < K)[None, :]
            tl.store(there + offs, tl.load(a_ptr + offs, mask=mask), mask=mask)
        # every thread's stores of the piece before the one releasing add (cumulativity)
        tl.debug_barrier()
        tl.atomic_add(rma.translate(counts_half + slot * SEGMENTS + piece * PIECE_ROWS // seg_rows, rank, dst,
                                    heap_bases), 1, sem="release", scope="sys")


@triton.jit
def _shard_tile(a_ptr, b_ptr, c_ptr, src, pid_m, pid_n, rows, N, K, k_blocks, stride_bk, stride_bn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                INTERPRET: tl.constexpr, POISON: tl.constexpr = False):
    """Tile (pid_m, pid_n) of C's rows from rank src's shard, whose rows `a_ptr` holds ([rows, K]);
    with POISON, NaN instead (rows that never arrived)."""
    if POISON:
        acc = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
    else:
        acc = gemm_tile(a_ptr, b_ptr, pid_m, pid_n, rows, N, K, 0, k_blocks, K, 1, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET)
    c_shard = c_ptr + tl.cast(src, tl.int64) * rows * N
    store_tile(c_shard, c_shard, acc, pid_m, pid_n, rows, N, N, 1, BLOCK_M, BLOCK_N)


@triton.jit
def _first_of(first, end, lane, lanes):
    """My first item of first..end-1, dealt round robin from item 0 on to `lanes` programs, of
    which I am `lane` (none where lane < 0: a pusher, in work the others take alone)."""
    mine = first + (lane - first % lanes + lanes) % lanes
    if lane < 0:
        mine = end
    return mine


@triton.jit
def _peer_tile(item, first, rb_lo, seg_blocks, tiles_n, WORLD: tl.constexpr, GROUP_M: tl.constexpr):
    """(peer index j, tile row, tile column) of item `item` of a segment whose items start at
    `first`: the tiles of the segment's row blocks in grouped order, each for every peer in turn
    (one B panel serves W - 1 programs at once)."""
    idx = item - first
    pid_m, pid_n = tile_coords(idx // (WORLD - 1), seg_blocks, tiles_n, GROUP_M)
    return idx % (WORLD - 1), rb_lo + pid_m, pid_n


@triton.jit
def ag_gemm_kernel(a_ptr, b_ptr, c_ptr, gathered_ptr, counts_ptr, calls_ptr, rows, N, K, stride_bk, stride_bn,
                   slot_stride, pushers, join, rank, heap_bases, error_ptr,
                   WORLD: tl.constexpr, SEGMENTS: tl.constexpr, PIECE_ROWS: tl.constexpr, PUSH_COLS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, FLATTEN: tl.constexpr):
    """c[src * rows + i] = (row i of rank src's shard) @ B for every src; a is my shard [rows, K]
    (contiguous). gathered: [2, WORLD - 1, max_rows, K] (slot_stride = max_rows * K); counts:
    [2, WORLD - 1, SEGMENTS]. The first min(pushers, programs) programs push (at least one), then
    multiply peers' rows from segment `join` on (where the others have not started them yet when the
    pushes end: the host's estimate, ops.ag_gemm.push_plan). PIECE_ROWS divides BLOCK_M, so a piece lies
    in one segment."""
    epoch, ok = calls.begin_call(calls_ptr, error_ptr)
    half = epoch % 2
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    S = tl.minimum(pushers, P)
    tiles_n = tl.cdiv(N, BLOCK_N)
    row_blocks = tl.cdiv(rows, BLOCK_M)
    per_shard = row_blocks * tiles_n
    k_blocks = tl.cdiv(K, BLOCK_K)
    seg_blocks = tl.cdiv(row_blocks, SEGMENTS)  # row blocks per segment (the last may have fewer)
    gathered_half = gathered_ptr + tl.cast(half, tl.int64) * (WORLD - 1) * slot_stride
    counts_half = counts_ptr + half * (WORLD - 1) * SEGMENTS
    if ok & (pid < S):
        _push_shard(a_ptr, gathered_half, counts_half, rows, K, slot_stride, seg_blocks * BLOCK_M, pid, S, rank,
                    heap_bases, WORLD, SEGMENTS, PIECE_ROWS, PUSH_COLS)
    # programs other than the pushers are lanes 0.. of the work they alone take (all, where every
    # program pushes): my own rows, and the peers' segments before `join`
    lane = pid
    lanes = P
    if P > S:
        lane = pid - S
        lanes = P - S
    for item in tl.range(_first_of(0, per_shard, lane, lanes), per_shard, lanes, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(item, row_blocks, tiles_n, GROUP_M)
        _shard_tile(a_ptr, b_ptr, c_ptr, rank, pid_m, pid_n, rows, N, K, k_blocks, stride_bk, stride_bn,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET)
    # the peers' rows, segment by segment; items are numbered across segments, so each segment's
    # share continues the round robin where the last one stopped
    for s in tl.static_range(SEGMENTS):
        rb_lo = s * seg_blocks
        blocks = tl.maximum(tl.minimum(row_blocks - rb_lo, seg_blocks), 0)
        first = (WORLD - 1) * rb_lo * tiles_n
        items = (WORLD - 1) * blocks * tiles_n
        seg_lane = lane
        seg_lanes = lanes
        if s >= join:
            seg_lane = pid
            seg_lanes = P
        mine = _first_of(first, first + items, seg_lane, seg_lanes)
        # a program with tiles in the segment waits for its pieces; every piece lies in a segment with
        # tiles, so each is waited for by some program (the zeroing below relies on it)
        if mine < first + items:
            pieces = tl.cdiv(tl.minimum(rows - rb_lo * BLOCK_M, seg_blocks * BLOCK_M), PIECE_ROWS)
            for j in tl.static_range(WORLD - 1):
                ok = ok & rma.signal_wait(counts_half + j * SEGMENTS + s, tl.cast(pieces, tl.int64), rank,
                                          (rank + 1 + j) % WORLD, heap_bases, error_ptr)
        end = first + items
        if not ok:
            end = first
        for item in tl.range(mine, end, seg_lanes, flatten=FLATTEN):
            j, pid_m, pid_n = _peer_tile(item, first, rb_lo, blocks, tiles_n, WORLD, GROUP_M)
            _shard_tile(gathered_half + tl.cast(j, tl.int64) * slot_stride, b_ptr, c_ptr, (rank + 1 + j) % WORLD,
                        pid_m, pid_n, rows, N, K, k_blocks, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                        INTERPRET)
        if not ok:  # rows that may never have arrived: NaN, not stale or unwritten memory
            for item in range(mine, first + items, seg_lanes):
                j, pid_m, pid_n = _peer_tile(item, first, rb_lo, blocks, tiles_n, WORLD, GROUP_M)
                _shard_tile(gathered_half, b_ptr, c_ptr, (rank + 1 + j) % WORLD, pid_m, pid_n, rows, N, K, k_blocks,
                            stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET, POISON=True)
    if calls.finish_call(calls_ptr, epoch):
        # every program has passed its waits on this half's counts, and every count was waited for
        # (all pieces of the call are in): zero them for call e + 2
        for i in tl.static_range((WORLD - 1) * SEGMENTS):
            tl.store(counts_half + i, 0)
