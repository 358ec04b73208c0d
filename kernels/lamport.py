"""Receive slots whose data marks its own arrival (Lamport style), shared by the one-shot and two-shot
all-reduce (kernels/all_reduce.py), the fused all-reduce + RMSNorm (all_reduce_norm.py) and GEMM +
all-reduce (gemm_ar.py).

A receive slot holds NOT_YET (every bit set: a NaN with the sign and the whole payload set) in each
element until a peer's push overwrites it; a reader spins on its own memory until no element of its
block holds the pattern, so the loads that see the data are the reads of the data. Senders replace
NOT_YET in what they send with the same NaN without its sign bit (`sendable`), so no value can look
like "not arrived" (a NaN stays a NaN). The reader puts NOT_YET back into what it consumed
(`not_yet`), so every slot is clean when its call ends; kernels/all_reduce.py says why two slots,
alternating by call parity, suffice.

Receive tiles are [elements, PEERS]: column j holds the copy of rank (rank + 1 + j) % W
(`peer_tile`), so one spin covers every peer.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma, triton_compat


# Elements of a receive tile per thread, at least. With fewer, a [rows, PEERS] tile's peers spread over
# the threads, and H200x4 measured the one-shot at 8 KB-512 KB taking 31-36 us with 16 per thread and
# 98-105 us with 8, against 6.1-7.5 us with 32 or more, whatever the warp count (bench/notes/allreduce.md,
# "The W=4 cliff"). At W=2 (one column) the tile never crossed it; at W=4 the old 4096-element tile
# at 8 warps did.
TILE_ELEMS_PER_THREAD = 32


def tile_elems(threads: int) -> int:
    """Elements of a receive tile (all peers' columns together) for a program of `threads` threads."""
    return TILE_ELEMS_PER_THREAD * threads


def peers_pow2(world: int) -> int:
    """Columns of a receive tile: one per peer, rounded up to a power of two."""
    return triton.next_power_of_2(max(world - 1, 1))


@triton.jit
def flag(cond):
    """A scalar condition that masks accept: the Triton 3.9 interpreter types a bare scalar
    comparison as an integer, which tl.load and tl.store reject as a mask."""
    f = True
    return f & cond


@triton.jit
def bits(v):
    """The bit pattern of a float block (bf16/fp16 -> int16, fp32 -> int32)."""
    if v.dtype.primitive_bitwidth == 16:
        return v.to(tl.int16, bitcast=True)
    else:
        return v.to(tl.int32, bitcast=True)


@triton.jit
def sendable(b):
    """`b` (bits) with NOT_YET (-1) replaced by the same NaN without its sign bit."""
    return tl.where(b == -1, tl.full(b.shape, (1 << (b.dtype.primitive_bitwidth - 1)) - 1, b.dtype), b)


@triton.jit
def not_yet(ptrs, mask):
    """Put NOT_YET back into a consumed block of a receive slot."""
    tl.store(ptrs, tl.full(ptrs.shape, -1, ptrs.dtype.element_ty), mask=mask)


@triton.jit
def advance(epoch_ptr):
    """This call's epoch of a chunk (the calls that used it before), and count this one. Every
    thread loads it before any thread stores: a late warp must not read the advanced value."""
    epoch = tl.load(epoch_ptr)
    tl.debug_barrier()
    tl.store(epoch_ptr, epoch + 1)
    return epoch


@triton.jit
def _spin_state(ptrs, m, error_ptr, start, timeout, POLL_LOAD: tl.constexpr):
    """(tile, state): state, one value for the whole program out of a max-reduction, is 0 (all
    landed), 1 (some not yet), 2-3 (this thread or another is past the time bound: decide on the
    tile) or 4-7 (a wait of this rank gave up before)."""
    tile = tl.load(ptrs, mask=m, other=0, volatile=True, cache_modifier=POLL_LOAD)
    failed = tl.load(error_ptr, volatile=True)
    late = triton_compat.clock_ns() - start >= timeout
    state = tl.reduce(tl.reduce(tl.where(m & (tile == -1), 1, 0) | tl.where(late, 2, 0) | tl.where(failed != 0, 4, 0),
                                1, triton_compat.elementwise_max), 0, triton_compat.elementwise_max)
    return tile, state


@triton.jit
def wait_landed(ptrs, m, srcs, epoch, rank, heap_bases, error_ptr, POLL_LOAD: tl.constexpr):
    """Spin on a tile of my receive slots (`ptrs`, column j written by rank srcs[j]) until no
    element under `m` holds NOT_YET, until the heap's wait bound (rma.timeout_ns, wall-clock) has
    passed, or until the error slot says a wait of this rank has already given up. Returns (the
    tile's bits, landed). On the bound, the error slot names the lowest rank with a missing
    element, and its first missing element's address.

    The spin state comes out of a reduction that every thread receives, so all threads leave the
    loop at the same poll and take the same branches after it, which hold barriers; each thread's
    clock only feeds that reduction. It is written out with core builtins and the standard max
    combine, which the interpreter reduces with numpy: a call to a jit function (tl.max included)
    costs the interpreter about a millisecond of patching, and this runs once per poll.
    POLL_LOAD ".cv" on CDNA: Triton turns loads it can address from a buffer resource into buffer
    loads and drops `volatile` on the way; the cache modifier survives and keeps them coherent."""
    timeout = rma.timeout_ns(error_ptr)
    start = triton_compat.clock_ns()
    tile, state = _spin_state(ptrs, m, error_ptr, start, timeout, POLL_LOAD)
    while state == 1:
        tile, state = _spin_state(ptrs, m, error_ptr, start, timeout, POLL_LOAD)
    lost = m & (tile == -1)
    landed = state == 0
    if (state == 2) | (state == 3):  # past the bound: the tile decides
        missing = tl.reduce(tl.reduce(tl.where(lost, 1, 0), 1, triton_compat.elementwise_max), 0,
                            triton_compat.elementwise_max)
        landed = missing == 0
        if missing != 0:
            peer = tl.min(tl.min(tl.where(lost, srcs, 1 << 30), axis=1), axis=0)
            addr = tl.min(tl.min(tl.where(lost & (srcs == peer), ptrs.to(tl.int64), 1 << 62), axis=1), axis=0)
            rma.report_stuck(addr.to(tl.pointer_type(tl.int8)), epoch + 1, epoch, rank, peer, heap_bases, error_ptr)
    return tile, landed


@triton.jit
def column(tile, j):
    """Column j of a tile of bits, exactly (a sum of one value and zeros, in integers)."""
    cols = tl.arange(0, tile.shape[1])[None, :]
    return tl.sum(tl.where(cols == j, tile, 0), axis=1).to(tile.dtype)


@triton.jit
def sum_in_rank_order(tile, mine, rank, WORLD: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 sum of every rank's block in rank order 0..W-1: `mine` for this rank, the column of
    `tile` that rank s's push landed in for the others (column j holds rank (rank + 1 + j) % W)."""
    acc = tl.full(mine.shape, -0.0, tl.float32)  # -0.0 + v == v for every v, signed zeros included
    for s in tl.static_range(WORLD):
        theirs = column(tile, (s - rank - 1 + WORLD) % WORLD).to(DTYPE, bitcast=True).to(tl.float32)
        acc += tl.where(s == rank, mine, theirs)
    return acc


@triton.jit
def peer_tile(rank, WORLD: tl.constexpr, PEERS: tl.constexpr):
    """(column index, writer rank) of the receive tile's columns, as [1, PEERS] rows."""
    cols = tl.arange(0, PEERS)
    return cols[None, :], ((rank + 1 + cols) % WORLD)[None, :]
