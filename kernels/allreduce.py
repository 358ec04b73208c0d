"""All-reduce over the symmetric heap, with arrival marked by the data itself (Lamport style):
one-shot (every rank pushes its message into every peer's heap and sums what it receives) for
small messages, two-shot (every rank pushes each chunk to the chunk's owner, c % W, which sums it
and pushes the sum back to everyone) for larger ones.

Why no flags: a receive slot holds NOT_YET (every bit set: a NaN with the sign and the whole
payload set) in each element until a peer's push overwrites it, and a reader spins on its own
memory until no element of its block holds the pattern; the loads that see the data are the
reads of the data. A message costs one one-way trip: no flag store, no release fence per peer,
no acquire, no CTA barrier before a release. Senders replace NOT_YET in what they send with the
same NaN without its sign bit, so no value can look like "not arrived" (a NaN stays a NaN).

Slots: two per chunk, and the call numbered e of a chunk (its epoch, counted in device memory by
this kernel, so replays of a CUDA graph advance it) uses slot e % 2. The reader puts NOT_YET back
into the block it consumed right after reading it, so every slot is clean when its call ends,
whatever sizes later calls use. That is safe because a peer is never more than one call ahead:
it cannot finish call e+1 without my push of e+1, which comes after my kernel of call e (reset
included) has ended. So while I read slot e % 2, only pushes of call e+1 can arrive, and they go
to the other slot. (Three slots would move the reset off the read path, at the price of keeping
each program's previous sizes in device memory; the reset is local stores issued beside the
output stores.)

Chunks are CHUNK_BYTES whatever the dtype, so a chunk's epoch and slots mean the same bytes in
every call. Program p owns chunks p, p+P, ...: it first pushes all of them (no waits), then
receives them in order, so the round trips of its chunks overlap, and it only ever waits on
program p of its peers. A chunk goes out whole; it comes in as receive tiles holding a piece of
every peer's copy at once, so one spin covers all peers.

Peer addresses come from rma.translate, which keeps Triton's alignment facts: pushes are 16-byte
vector stores, as local stores are.

The sum is fp32 in rank order 0..W-1, so every rank computes the same bits from the same inputs;
two-shot ranks copy the owner's bits.

A wait spins on a state that comes out of a CTA-wide reduction (so every thread of the program
leaves the spin at the same poll and takes the same branches after it), bounded by max_spins, and
also gives up at once when the heap's error slot is already set. A wait that gives up records
the stuck rank, peer and first missing element in the error slot (rma.report_stuck), writes no
output for its chunk, and its program skips its remaining chunks; a rank that has already failed
pushes nothing, so its peers give up too instead of running on.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma

# Bytes of a chunk, the unit of epochs and slots whatever the dtype: a program pushes a chunk in
# one go, 16-byte vectors for every thread of an 8-warp program (wave64 on CDNA included).
CHUNK_BYTES = 8192
# Elements of a receive tile (a piece of every peer's chunk at once) held in registers.
TILE_ELEMS = 4096


def peers_pow2(world: int) -> int:
    """Columns of a receive tile: one per peer, rounded up to a power of two."""
    return triton.next_power_of_2(max(world - 1, 1))


def sub_block(block: int, world: int) -> int:
    """Rows of a receive tile: the whole chunk (block elements) when it fits TILE_ELEMS."""
    return min(block, max(TILE_ELEMS // peers_pow2(world), 16))


@triton.jit
def _flag(cond):
    """A scalar condition that masks accept: the Triton 3.9 interpreter types a bare scalar
    comparison as an integer, which tl.load and tl.store reject as a mask."""
    flag = True
    return flag & cond


@triton.jit
def _bits(v):
    """The bit pattern of a float block (bf16/fp16 -> int16, fp32 -> int32)."""
    if v.dtype.primitive_bitwidth == 16:
        return v.to(tl.int16, bitcast=True)
    else:
        return v.to(tl.int32, bitcast=True)


@triton.jit
def _sendable(bits):
    """`bits` with NOT_YET (-1) replaced by the same NaN without its sign bit."""
    return tl.where(bits == -1, tl.full(bits.shape, (1 << (bits.dtype.primitive_bitwidth - 1)) - 1, bits.dtype),
                    bits)


@triton.jit
def _not_yet(ptrs, mask):
    """Put NOT_YET back into a consumed block of a receive slot."""
    tl.store(ptrs, tl.full(ptrs.shape, -1, ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _advance(epoch_ptr):
    """This call's epoch of a chunk (the calls that used it before), and count this one. Every
    thread loads it before any thread stores: a late warp must not read the advanced value."""
    epoch = tl.load(epoch_ptr)
    tl.debug_barrier()
    tl.store(epoch_ptr, epoch + 1)
    return epoch


@triton.jit
def _wait_landed(ptrs, m, srcs, epoch, rank, heap_bases, error_ptr, max_spins, POLL_LOAD: tl.constexpr):
    """Spin on a tile of my receive slots (`ptrs`, column j written by rank srcs[j]) until no
    element under `m` holds NOT_YET, or until the error slot says a wait of this rank has already
    given up. Returns (the tile's bits, landed). On the spin bound, the error slot names the lowest
    rank with a missing element, and its first missing element's address.

    `state` is 0 (all landed), 1 (some not yet) or 2-3 (given up before): one value for the whole
    program, out of a reduction that every thread receives, so it may decide the loop and the
    branches after it, which hold barriers. It is written out with core builtins and the standard
    max combine, which the interpreter reduces with numpy: a call to a jit function (tl.max
    included) costs the interpreter about a millisecond of patching, and this runs once per poll.
    POLL_LOAD ".cv" on CDNA: Triton turns loads it can address from a buffer resource into buffer
    loads and drops `volatile` on the way; the cache modifier survives and keeps them coherent."""
    tile = tl.load(ptrs, mask=m, other=0, volatile=True, cache_modifier=POLL_LOAD)
    failed = tl.load(error_ptr, volatile=True)
    state = tl.reduce(tl.reduce(tl.where(m & (tile == -1), 1, 0) | tl.where(failed != 0, 2, 0), 1,
                                tl.standard._elementwise_max), 0, tl.standard._elementwise_max)
    spins = 0
    while (state == 1) & (spins < max_spins):
        tile = tl.load(ptrs, mask=m, other=0, volatile=True, cache_modifier=POLL_LOAD)
        failed = tl.load(error_ptr, volatile=True)
        state = tl.reduce(tl.reduce(tl.where(m & (tile == -1), 1, 0) | tl.where(failed != 0, 2, 0), 1,
                                    tl.standard._elementwise_max), 0, tl.standard._elementwise_max)
        spins += 1
    if state == 1:
        lost = m & (tile == -1)
        peer = tl.min(tl.min(tl.where(lost, srcs, 1 << 30), axis=1), axis=0)
        addr = tl.min(tl.min(tl.where(lost & (srcs == peer), ptrs.to(tl.int64), 1 << 62), axis=1), axis=0)
        rma.report_stuck(addr.to(tl.pointer_type(tl.int8)), epoch + 1, epoch, rank, peer, heap_bases, error_ptr)
    return tile, state == 0


@triton.jit
def _column(tile, j):
    """Column j of a tile of bits, exactly (a sum of one value and zeros, in integers)."""
    cols = tl.arange(0, tile.shape[1])[None, :]
    return tl.sum(tl.where(cols == j, tile, 0), axis=1).to(tile.dtype)


@triton.jit
def _sum_in_rank_order(tile, mine, rank, W: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 sum of every rank's block in rank order 0..W-1: `mine` for this rank, the column of
    `tile` that rank s's push landed in for the others (column j holds rank (rank + 1 + j) % W)."""
    acc = tl.full(mine.shape, -0.0, tl.float32)  # -0.0 + v == v for every v, signed zeros included
    for s in tl.static_range(W):
        theirs = _column(tile, (s - rank - 1 + W) % W).to(DTYPE, bitcast=True).to(tl.float32)
        acc += tl.where(s == rank, mine, theirs)
    return acc


@triton.jit
def _peer_tile(rank, W: tl.constexpr, PEERS: tl.constexpr):
    """(column index, writer rank) of the receive tile's columns, as [1, PEERS] rows."""
    cols = tl.arange(0, PEERS)
    return cols[None, :], ((rank + 1 + cols) % W)[None, :]


@triton.jit
def one_shot_all_reduce_kernel(x_ptr, out_ptr, slots_ptr, epoch_ptr, n, slot_stride, src_stride, rank,
                               heap_bases, error_ptr, max_spins, W: tl.constexpr, PEERS: tl.constexpr,
                               BLOCK: tl.constexpr, SUB: tl.constexpr, PEER_STORE: tl.constexpr,
                               POLL_LOAD: tl.constexpr):
    """slots[e % 2][src][chunk] in every heap receives rank src's chunk in its call e. Chunks are
    pushed whole (BLOCK elements) and received SUB elements of every peer at a time."""
    pid = tl.program_id(0)
    chunks = tl.cdiv(n, BLOCK)
    lane = tl.arange(0, BLOCK)
    live = _flag(tl.load(error_ptr, volatile=True) == 0)  # a rank that has given up pushes nothing
    for c in range(pid, chunks, tl.num_programs(0)):
        offs = c * BLOCK + lane
        mask = offs < n
        epoch = _advance(epoch_ptr + c)
        bits = _sendable(_bits(tl.load(x_ptr + offs, mask=mask)))
        dst = slots_ptr + (epoch % 2) * slot_stride + rank * src_stride + offs
        for q in tl.static_range(1, W):
            peer = (rank + q) % W
            tl.store(rma.translate(dst, rank, peer, heap_bases), bits, mask=mask & live,
                     cache_modifier=PEER_STORE)
    tl.debug_barrier()  # the epochs stored above are read back below, by other threads
    ok = pid >= 0
    cols, srcs = _peer_tile(rank, W, PEERS)
    dtype = x_ptr.dtype.element_ty
    for c in range(pid, chunks, tl.num_programs(0)):
        epoch = tl.load(epoch_ptr + c) - 1
        for sub in range(0, BLOCK, SUB):
            if ok:
                offs = c * BLOCK + sub + tl.arange(0, SUB)
                mask = offs < n
                mine = _sendable(_bits(tl.load(x_ptr + offs, mask=mask, other=0)))
                ptrs = slots_ptr + (epoch % 2) * slot_stride + srcs * src_stride + offs[:, None]
                m = mask[:, None] & (cols < W - 1)
                tile, landed = _wait_landed(ptrs, m, srcs, epoch, rank, heap_bases, error_ptr, max_spins, POLL_LOAD)
                ok = ok & landed
                if ok:
                    acc = _sum_in_rank_order(tile, mine.to(dtype, bitcast=True).to(tl.float32), rank, W, dtype)
                    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
                    _not_yet(ptrs, m)


@triton.jit
def two_shot_all_reduce_kernel(x_ptr, out_ptr, scatter_ptr, gather_ptr, epoch_ptr, n, scatter_slot_stride,
                               scatter_src_stride, gather_slot_stride, rank, heap_bases, error_ptr, max_spins,
                               W: tl.constexpr, BLOCK: tl.constexpr, PEER_STORE: tl.constexpr,
                               POLL_LOAD: tl.constexpr):
    """Chunk c belongs to rank c % W. scatter[e % 2][src][c // W] in the owner's heap receives rank
    src's chunk c; gather[e % 2][c] in every other heap receives the owner's sum. Bandwidth, not
    latency, decides here: the owner takes its peers' chunks one at a time, in rank order, so
    every access is a whole chunk (16-byte vectors at any world size)."""
    pid = tl.program_id(0)
    chunks = tl.cdiv(n, BLOCK)
    lane = tl.arange(0, BLOCK)
    dtype = x_ptr.dtype.element_ty
    live = _flag(tl.load(error_ptr, volatile=True) == 0)
    for c in range(pid, chunks, tl.num_programs(0)):
        offs = c * BLOCK + lane
        mask = offs < n
        epoch = _advance(epoch_ptr + c)
        owner = c % W
        bits = _sendable(_bits(tl.load(x_ptr + offs, mask=mask)))
        dst = scatter_ptr + (epoch % 2) * scatter_slot_stride + rank * scatter_src_stride + (c // W) * BLOCK + lane
        tl.store(rma.translate(dst, rank, owner, heap_bases), bits,
                 mask=mask & live & _flag(owner != rank), cache_modifier=PEER_STORE)
    tl.debug_barrier()  # the epochs stored above are read back below, by other threads
    ok = pid >= 0
    # the chunks I own: sum them, keep the sum, push it into every peer's gather slot
    for c in range(pid, chunks, tl.num_programs(0)):
        if ok & (c % W == rank):
            offs = c * BLOCK + lane
            mask = offs < n
            epoch = tl.load(epoch_ptr + c) - 1
            acc = tl.full((BLOCK,), -0.0, tl.float32)  # -0.0 + v == v for every v, signed zeros included
            for s in tl.static_range(W):
                if ok:
                    if s == rank:
                        mine = _sendable(_bits(tl.load(x_ptr + offs, mask=mask, other=0)))
                        acc += mine.to(dtype, bitcast=True).to(tl.float32)
                    else:
                        ptrs = (scatter_ptr + (epoch % 2) * scatter_slot_stride + s * scatter_src_stride
                                + (c // W) * BLOCK + lane[:, None])
                        tile, landed = _wait_landed(ptrs, mask[:, None], s, epoch, rank, heap_bases, error_ptr,
                                                    max_spins, POLL_LOAD)
                        ok = ok & landed
                        if ok:
                            acc += _column(tile, 0).to(dtype, bitcast=True).to(tl.float32)
                            _not_yet(ptrs, mask[:, None])
            if ok:
                total = _sendable(_bits(acc.to(dtype)))
                dst = gather_ptr + (epoch % 2) * gather_slot_stride + offs
                for q in tl.static_range(1, W):
                    peer = (rank + q) % W
                    tl.store(rma.translate(dst, rank, peer, heap_bases), total, mask=mask,
                             cache_modifier=PEER_STORE)
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty, bitcast=True), mask=mask)
    # the chunks others own: copy their owner's sum
    for c in range(pid, chunks, tl.num_programs(0)):
        if ok & (c % W != rank):
            offs = c * BLOCK + lane
            mask = offs < n
            epoch = tl.load(epoch_ptr + c) - 1
            ptrs = gather_ptr + (epoch % 2) * gather_slot_stride + offs[:, None]
            tile, landed = _wait_landed(ptrs, mask[:, None], c % W, epoch, rank, heap_bases, error_ptr, max_spins,
                                        POLL_LOAD)
            ok = ok & landed
            if ok:
                tl.store(out_ptr + offs, _column(tile, 0).to(out_ptr.dtype.element_ty, bitcast=True), mask=mask)
                _not_yet(ptrs, mask[:, None])
