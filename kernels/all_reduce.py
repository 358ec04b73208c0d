"""All-reduce over the symmetric heap, with arrival marked by the data itself (Lamport style):
one-shot (every rank pushes its message into every peer's heap and sums what it receives) for
small messages, two-shot (every rank pushes each chunk to the chunk's owner, c % W, which sums it
and pushes the sum back to everyone) for larger ones.

Why no flags: a receive slot holds NOT_YET until a peer's push overwrites it, and a reader spins
on its own memory until no element of its block holds it (kernels/lamport.py); the loads that
see the data are the reads of the data. A message costs one one-way trip: no flag store, no
release fence per peer, no acquire, no CTA barrier before a release.

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
leaves the spin at the same poll and takes the same branches after it), bounded in time
(lamport.wait_landed), and also gives up at once when the heap's error slot is already set. A
wait that gives up records the stuck rank, peer and first missing element in the error slot
(rma.report_stuck); its chunk's output, and that of every later chunk of its program, is NaN
(`poison`), never stale or uninitialised memory; a rank that has already failed pushes nothing,
so its peers give up too instead of running on.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma
from tp_overlap_plugin.kernels.lamport import (advance, bits, column, flag, not_yet, peer_tile, peers_pow2, sendable,
                                               sum_in_rank_order, tile_elems, wait_landed)

# Bytes of a chunk, the unit of epochs and slots whatever the dtype: a program pushes a chunk in
# one go, 16-byte vectors for every thread of an 8-warp program (wave64 on CDNA included).
CHUNK_BYTES = 8192


def sub_block(block: int, world: int, threads: int) -> int:
    """Rows of a receive tile (a piece of every peer's chunk at once, held in registers): the whole
    chunk (block elements) where it fits lamport.tile_elems, else as many rows as do."""
    return min(block, max(tile_elems(threads) // peers_pow2(world), 16))


@triton.jit
def poison(out_ptr, offs, mask):
    """What a chunk gets whose sum this rank could not form: NaN, which no result can be taken for."""
    tl.store(out_ptr + offs, tl.full(offs.shape, float("nan"), out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def one_shot_all_reduce_kernel(x_ptr, out_ptr, slots_ptr, epoch_ptr, n, slot_stride, src_stride, rank,
                               heap_bases, error_ptr, WORLD: tl.constexpr, PEERS: tl.constexpr,
                               BLOCK: tl.constexpr, SUB: tl.constexpr, PEER_STORE: tl.constexpr,
                               POLL_LOAD: tl.constexpr):
    """slots[e % 2][src][chunk] in every heap receives rank src's chunk in its call e. Chunks are
    pushed whole (BLOCK elements) and received SUB elements of every peer at a time."""
    pid = tl.program_id(0)
    chunks = tl.cdiv(n, BLOCK)
    lane = tl.arange(0, BLOCK)
    live = flag(rma.no_error(error_ptr))  # a rank that has given up pushes nothing
    for c in range(pid, chunks, tl.num_programs(0)):
        offs = c * BLOCK + lane
        mask = offs < n
        epoch = advance(epoch_ptr + c)
        payload = sendable(bits(tl.load(x_ptr + offs, mask=mask)))
        dst = slots_ptr + (epoch % 2) * slot_stride + rank * src_stride + offs
        for q in tl.static_range(1, WORLD):
            peer = (rank + q) % WORLD
            tl.store(rma.translate(dst, rank, peer, heap_bases), payload, mask=mask & live,
                     cache_modifier=PEER_STORE)
    tl.debug_barrier()  # the epochs stored above are read back below, by other threads
    ok = pid >= 0
    cols, srcs = peer_tile(rank, WORLD, PEERS)
    dtype = x_ptr.dtype.element_ty
    for c in range(pid, chunks, tl.num_programs(0)):
        epoch = tl.load(epoch_ptr + c) - 1
        for sub in range(0, BLOCK, SUB):
            if ok:
                offs = c * BLOCK + sub + tl.arange(0, SUB)
                mask = offs < n
                mine = sendable(bits(tl.load(x_ptr + offs, mask=mask, other=0)))
                ptrs = slots_ptr + (epoch % 2) * slot_stride + srcs * src_stride + offs[:, None]
                m = mask[:, None] & (cols < WORLD - 1)
                tile, landed = wait_landed(ptrs, m, srcs, epoch, rank, heap_bases, error_ptr, POLL_LOAD)
                ok = ok & landed
                if ok:
                    acc = sum_in_rank_order(tile, mine.to(dtype, bitcast=True).to(tl.float32), rank, WORLD, dtype)
                    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
                    not_yet(ptrs, m)
            if not ok:
                offs = c * BLOCK + sub + tl.arange(0, SUB)
                poison(out_ptr, offs, offs < n)


@triton.jit
def two_shot_all_reduce_kernel(x_ptr, out_ptr, scatter_ptr, gather_ptr, epoch_ptr, n, scatter_slot_stride,
                               scatter_src_stride, gather_slot_stride, rank, heap_bases, error_ptr,
                               WORLD: tl.constexpr, BLOCK: tl.constexpr, PEER_STORE: tl.constexpr,
                               POLL_LOAD: tl.constexpr):
    """Chunk c belongs to rank c % W. scatter[e % 2][src][c // W] in the owner's heap receives rank
    src's chunk c; gather[e % 2][c] in every other heap receives the owner's sum. Bandwidth, not
    latency, decides here: the owner takes its peers' chunks one at a time, in rank order, so
    every access is a whole chunk (16-byte vectors at any world size)."""
    pid = tl.program_id(0)
    chunks = tl.cdiv(n, BLOCK)
    lane = tl.arange(0, BLOCK)
    dtype = x_ptr.dtype.element_ty
    live = flag(rma.no_error(error_ptr))
    for c in range(pid, chunks, tl.num_programs(0)):
        offs = c * BLOCK + lane
        mask = offs < n
        epoch = advance(epoch_ptr + c)
        owner = c % WORLD
        payload = sendable(bits(tl.load(x_ptr + offs, mask=mask)))
        dst = scatter_ptr + (epoch % 2) * scatter_slot_stride + rank * scatter_src_stride + (c // WORLD) * BLOCK + lane
        tl.store(rma.translate(dst, rank, owner, heap_bases), payload,
                 mask=mask & live & flag(owner != rank), cache_modifier=PEER_STORE)
    tl.debug_barrier()  # the epochs stored above are read back below, by other threads
    ok = pid >= 0
    # the chunks I own: sum them, keep the sum, push it into every peer's gather slot
    for c in range(pid, chunks, tl.num_programs(0)):
        if c % WORLD == rank:
            offs = c * BLOCK + lane
            mask = offs < n
            epoch = tl.load(epoch_ptr + c) - 1
            acc = tl.full((BLOCK,), -0.0, tl.float32)  # -0.0 + v == v for every v, signed zeros included
            for s in tl.static_range(WORLD):
                if ok:
                    if s == rank:
                        mine = sendable(bits(tl.load(x_ptr + offs, mask=mask, other=0)))
                        acc += mine.to(dtype, bitcast=True).to(tl.float32)
                    else:
                        ptrs = (scatter_ptr + (epoch % 2) * scatter_slot_stride + s * scatter_src_stride
                                + (c // WORLD) * BLOCK + lane[:, None])
                        tile, landed = wait_landed(ptrs, mask[:, None], s, epoch, rank, heap_bases, error_ptr,
                                                   POLL_LOAD)
                        ok = ok & landed
                        if ok:
                            acc += column(tile, 0).to(dtype, bitcast=True).to(tl.float32)
                            not_yet(ptrs, mask[:, None])
            if ok:
                total = sendable(bits(acc.to(dtype)))
                dst = gather_ptr + (epoch % 2) * gather_slot_stride + offs
                for q in tl.static_range(1, WORLD):
                    peer = (rank + q) % WORLD
                    tl.store(rma.translate(dst, rank, peer, heap_bases), total, mask=mask,
                             cache_modifier=PEER_STORE)
                tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty, bitcast=True), mask=mask)
            else:
                poison(out_ptr, offs, mask)
    # the chunks others own: copy their owner's sum
    for c in range(pid, chunks, tl.num_programs(0)):
        if c % WORLD != rank:
            offs = c * BLOCK + lane
            mask = offs < n
            if ok:
                epoch = tl.load(epoch_ptr + c) - 1
                ptrs = gather_ptr + (epoch % 2) * gather_slot_stride + offs[:, None]
                tile, landed = wait_landed(ptrs, mask[:, None], c % WORLD, epoch, rank, heap_bases, error_ptr, POLL_LOAD)
                ok = ok & landed
                if ok:
                    tl.store(out_ptr + offs, column(tile, 0).to(out_ptr.dtype.element_ty, bitcast=True), mask=mask)
                    not_yet(ptrs, mask[:, None])
            if not ok:
                poison(out_ptr, offs, mask)
