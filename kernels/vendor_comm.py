"""The communication of the chunked fused ops (tp_overlap_plugin/ops/chunked.py), whose GEMMs are the
vendor library's (cuBLAS, hipBLASLt), one per chunk, on the op's stream: these kernels move the
chunks between heaps beside them, on a side stream, on a few programs, and wait for them.

Why a second design beside the one-launch fused ops (kernels/ag_gemm.py, gemm_rs.py): inside the
engine's prefill step those ran at the sum of their GEMM and their transfer, not the larger of
the two (bench/notes/prefill.md), and their Triton tiles by pointer cost 1.05-1.4x the vendor's.
Here the GEMMs are the vendor's own kernels, and the transfer runs concurrently on its own programs.

Buffers in the heap, per op (ops/slots.alloc_peer_slots, only half 0 used): `slots[j]` receives the
rows (AG: my peers' shards) or partials (RS: my rows of their products) of rank me + 1 + j;
`counts[j, s]` counts the pieces of chunk s that rank delivered (its pushers are the only writers);
`free[j]` is the last call number in which rank me + 1 + j finished reading what I pushed it (it
writes it, in my heap). There is one buffer, not one per call parity: a pusher waits for the
owner's `free` of the previous call before it stores anything, so a slot is never overwritten
while its owner still reads it, whichever ops the owner ran in between. The owner zeroes its
counts before it signals `free`, and its signal releases the zeroing.

`calls[1]` is the number of the last call finished on this rank (calls.py); the kernel that ends a
call (`signal_free_kernel`, or the reduction's last program) advances it, so every kernel of call e,
on either stream, reads e from device memory, as a graph replay needs.

Waits are bounded (rma.signal_wait). A rank whose wait gave up pushes nothing more; its rows that
never arrived are NaN (AG), and its reduced rows NaN (RS), never stale memory.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import calls, rma


@triton.jit
def _wait_free(free_ptr, epoch, rank, heap_bases, error_ptr, WORLD: tl.constexpr):
    """Until every peer has finished reading what I pushed it in the previous call."""
    ok = True
    ok = ok & rma.no_error(error_ptr)
    for j in tl.static_range(WORLD - 1):
        if ok:
            ok = ok & rma.signal_wait(free_ptr + j, epoch - 1, rank, (rank + 1 + j) % WORLD, heap_bases, error_ptr)
    return ok


@triton.jit
def push_rows_kernel(src_ptr, slots_ptr, counts_ptr, free_ptr, calls_ptr, rows, src_stride, src_peer_stride,
                     cols, col0, slot_cols, slot_stride, seg, seg_rows, rank, heap_bases, error_ptr,
                     WORLD: tl.constexpr, SEGMENTS: tl.constexpr, PIECE_ROWS: tl.constexpr, PUSH_COLS: tl.constexpr):
    """Push to every peer dst its rows: rows [0, rows) of `src_ptr + dst * src_peer_stride` (row
    stride src_stride, `cols` columns) into my slot in dst's heap, columns col0.. of rows of
    slot_cols values. Pieces of PIECE_ROWS rows, the peers interleaved piece by piece (every link of
    a full mesh busy at once); after each piece one releasing add to dst's count of its chunk:
    `seg` where seg >= 0 (one chunk per launch: RS's column chunks), else row // seg_rows (AG's row
    chunks). AG pushes the same rows to everyone (src_peer_stride 0)."""
    epoch = calls.call_number(calls_ptr)
    ok = _wait_free(free_ptr, epoch, rank, heap_bases, error_ptr, WORLD)
    r = tl.arange(0, PIECE_ROWS)
    c = tl.arange(0, PUSH_COLS)
    units = tl.cdiv(rows, PIECE_ROWS) * (WORLD - 1)
    if not ok:
        units = 0
    for unit in range(tl.program_id(0), units, tl.num_programs(0)):
        piece = unit // (WORLD - 1)
        j = unit % (WORLD - 1)
        dst = (rank + 1 + j) % WORLD
        slot = WORLD - 2 - j  # mine in dst's heap: (rank - dst - 1) mod W
        row = (piece * PIECE_ROWS + r).to(tl.int64)
        src = src_ptr + tl.cast(dst, tl.int64) * src_peer_stride
        there = rma.translate(slots_ptr + tl.cast(slot, tl.int64) * slot_stride, rank, dst, heap_bases)
        for c0 in range(0, cols, PUSH_COLS):
            mask = (row < rows)[:, None] & ((c0 + c) < cols)[None, :]
            v = tl.load(src + row[:, None] * src_stride + (c0 + c)[None, :], mask=mask)
            tl.store(there + row[:, None] * slot_cols + (col0 + c0 + c)[None, :], v, mask=mask)
        chunk = seg
        if seg < 0:
            chunk = piece * PIECE_ROWS // seg_rows
        # every thread's stores of the piece before the one releasing add (cumulativity)
        tl.debug_barrier()
        tl.atomic_add(rma.translate(counts_ptr + slot * SEGMENTS + chunk, rank, dst, heap_bases), 1,
                      sem="release", scope="sys")


@triton.jit
def wait_rows_kernel(slots_ptr, counts_ptr, rank, heap_bases, error_ptr, row0, rows, cols, slot_stride, pieces,
                     seg_lo, seg_hi, WORLD: tl.constexpr, SEGMENTS: tl.constexpr, BLOCK: tl.constexpr):
    """One program: wait until every peer's counts of chunks seg_lo..seg_hi-1 are `pieces` each. One
    program, so that waiting holds one SM, not the grid the GEMMs and the pushers need (a reduction
    grid that spun on its inputs held every SM while the peers' pushers waited for one: 0.8 ms for
    o_proj's 0.1). Where a wait gave up, rows [row0, row0 + rows) of every slot become NaN (AG: the
    rows a GEMM reads next; RS passes rows = 0, its reduction writes NaN itself)."""
    ok = True
    ok = ok & rma.no_error(error_ptr)
    for j in tl.static_range(WORLD - 1):
        for s in tl.static_range(SEGMENTS):
            if ok & (s >= seg_lo) & (s < seg_hi):
                ok = ok & rma.signal_wait(counts_ptr + j * SEGMENTS + s, tl.cast(pieces, tl.int64), rank,
                                          (rank + 1 + j) % WORLD, heap_bases, error_ptr)
    if not ok:
        offs = tl.arange(0, BLOCK)
        for slot in range(WORLD - 1):
            base = slots_ptr + tl.cast(slot, tl.int64) * slot_stride + tl.cast(row0, tl.int64) * cols
            for i in range(0, rows * cols, BLOCK):
                tl.store(base + i + offs, float("nan"), mask=i + offs < rows * cols)


@triton.jit
def _signal_free(counts_ptr, free_ptr, epoch, rank, heap_bases, WORLD: tl.constexpr, SEGMENTS: tl.constexpr):
    """My counts to zero for the next call, then `epoch` into every peer's free word for me, releasing."""
    for i in tl.static_range((WORLD - 1) * SEGMENTS):
        tl.store(counts_ptr + i, 0)
    tl.debug_barrier()
    for j in tl.static_range(WORLD - 1):
        src = (rank + 1 + j) % WORLD
        # my index in src's heap: (rank - src - 1) mod W
        tl.atomic_xchg(rma.translate(free_ptr + (WORLD - 2 - j), rank, src, heap_bases), epoch,
                       sem="release", scope="sys")


@triton.jit
def signal_free_kernel(counts_ptr, free_ptr, calls_ptr, rank, heap_bases,
                       WORLD: tl.constexpr, SEGMENTS: tl.constexpr):
    """One program, after the call's last read of my slots (AG's last GEMM): ends the call."""
    epoch = calls.call_number(calls_ptr)
    _signal_free(counts_ptr, free_ptr, epoch, rank, heap_bases, WORLD, SEGMENTS)
    tl.store(calls_ptr + 1, epoch)


@triton.jit
def reduce_rows_kernel(own_ptr, own_seg_stride, slots_ptr, counts_ptr, free_ptr, calls_ptr, out_ptr, rows, N, seg_cols,
                       slot_stride, pieces, rank, heap_bases, error_ptr, used, WORLD: tl.constexpr,
                       SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """RS's reduction: out[rows, N] = the W partials of my rows summed in rank order 0..W-1 in fp32
    (every rank rounds alike, whatever the arrival order). The product's column chunk s (of `used`)
    is `own_ptr + s * own_seg_stride`, all W * rows rows of its width (seg_cols, the last one what is
    left of N), my rows at rank * rows; a peer's partial is in its slot, [rows, N]. Every program
    waits for every chunk of every peer first; the last one to finish ends the call (zeroes my
    counts, signals free, advances the call number). The host launches it after wait_rows_kernel has
    waited for the same counts: these waits then pass at once, and are here so that no program can
    read a partial that has not landed, whatever ran before."""
    epoch = calls.call_number(calls_ptr)
    ok = True
    ok = ok & rma.no_error(error_ptr)
    for j in tl.static_range(WORLD - 1):
        for s in tl.static_range(SEGMENTS):
            if ok & (s < used):
                ok = ok & rma.signal_wait(counts_ptr + j * SEGMENTS + s, tl.cast(pieces, tl.int64), rank,
                                          (rank + 1 + j) % WORLD, heap_bases, error_ptr)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tl.cdiv(rows, BLOCK_M) * tiles_n, tl.num_programs(0)):
        r = ((tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        c = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (r < rows)[:, None] & (c < N)[None, :]
        seg = c // seg_cols
        width = tl.minimum(seg_cols, N - seg * seg_cols)
        own = (own_ptr + seg[None, :].to(tl.int64) * own_seg_stride + (rank * rows + r)[:, None] * width[None, :]
               + (c - seg * seg_cols)[None, :])
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for src in tl.static_range(WORLD):
            p = slots_ptr + tl.cast((src - rank - 1 + WORLD) % WORLD, tl.int64) * slot_stride + r[:, None] * N + c[None, :]
            if src == rank:
                p = own
            acc += tl.load(p, mask=mask, other=0.0).to(tl.float32)
        if not ok:
            acc = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
        tl.store(out_ptr + r[:, None] * N + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    if calls.finish_call(calls_ptr, epoch):
        _signal_free(counts_ptr, free_ptr, epoch, rank, heap_bases, WORLD, SEGMENTS)
