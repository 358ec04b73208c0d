"""AG-GEMM in one persistent launch: C = all_gather(A_shard) @ B, the gather hidden behind the GEMM.

Work items are C's tiles in shard order, mine first: shard s of the walk is rank (me - s) mod W,
which is the order the peers' rows reach me (each rank pushes to rank + 1 first). A program takes
the next item from the op's work queue (kernels/work_queue.py), so programs that are busy pushing,
or waiting for a row block, simply take fewer tiles.

Two producers of the peers' rows, one consumer:
- programs: the first `pushers` programs first copy my shard into every peer's heap, row block by
  row block (BLOCK_M rows, the consumers' tile height), each block followed by its flag, while the
  others start on my own rows at once. Capturable as it is; costs those SMs.
- the copy engine: the host enqueues, on a side stream, a memcpy per chunk of rows into each peer's
  heap and an 8-byte memcpy of the call number into that chunk's flag (no SM involved, so nothing
  the GEMM's resident programs wait for needs an SM to become free). The peers' buffers are single
  (a memcpy's destination is fixed when a graph is captured), so copy_engine_begin_kernel first
  has all ranks meet: after it, every peer has finished reading the previous call's rows.
A tile of a peer's rows waits for its row block's (or chunk's) flag only, not the whole shard.

Buffers in the heap, per op: `gathered[half, slot]` holds the rows of the peer whose slot it is
(slot = (src - me - 1) mod W, so W - 1 slots), `flags[slot, row block or chunk]` is written by
that peer only. With program pushes the half is the call number's parity (device memory); reuse is
safe with two halves:
a rank's pushes of call e go to half e % 2 of a peer, which last read it in call e - 2; the rank
reaches call e only after its call e - 1 saw that peer's rows of e - 1, which the peer pushes after
its call e - 2 has finished.

The tiles are the one GEMM core's (kernels/gemm.py: tile_coords, gemm_tile, store_tile), by
pointer: rows a peer delivers are read with ordinary loads, which the flag's acquire orders; nothing
portable orders the tensor-copy engine's reads after it.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma, work_queue
from tp_overlap_plugin.kernels.gemm import gemm_tile, store_tile, tile_coords


@triton.jit
def copy_rows(src_ptr, dst_ptr, row0, rows, K, BLOCK_M: tl.constexpr, COLS: tl.constexpr):
    """dst[row0 : row0 + BLOCK_M] = src[same rows] for rows below `rows`; both [*, K] row-major."""
    r = row0 + tl.arange(0, BLOCK_M)
    at = r.to(tl.int64)[:, None] * K
    for k0 in range(0, K, COLS):
        cols = k0 + tl.arange(0, COLS)
        mask = (r < rows)[:, None] & (cols < K)[None, :]
        tl.store(dst_ptr + at + cols[None, :], tl.load(src_ptr + at + cols[None, :], mask=mask), mask=mask)


@triton.jit
def copy_engine_begin_kernel(queue_ptr, push_ptr, flags_ptr, rank, world, heap_bases, error_ptr, max_spins):
    """Before the copy engine pushes call e into the peers' (single) buffers: every rank meets here,
    after its call e - 1 has read them, and e becomes the value the engine copies into the flags.
    A rank that has given up leaves it at e - 1, so its peers time out rather than take its rows."""
    epoch = work_queue.call_number(queue_ptr)
    if rma.barrier(flags_ptr, epoch, rank, world, heap_bases, error_ptr, max_spins):
        tl.store(push_ptr, epoch)


@triton.jit
def ag_gemm_kernel(a_ptr, b_ptr, c_ptr, gathered_ptr, full_ptr, rows, N, K, stride_bk, stride_bn, slot_stride,
                   halves, flags_ptr, flag_stride, chunk_rows, queue_ptr, pushers, rank, world, heap_bases,
                   error_ptr, max_spins,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, PUSH_COLS: tl.constexpr, GATHER: tl.constexpr):
    """c[src * rows + i] = (row i of rank src's shard) @ B for every src; a is my shard [rows, K].
    With GATHER, full[src * rows + i] = that row too (one program per row block copies it).

    The producer is either these programs (pushers > 0: row blocks, two buffer halves, flags per
    row block) or the copy engine (pushers = 0, `halves` = 1: the host enqueues the pushes on a
    side stream after copy_engine_begin_kernel, one flag per `chunk_rows` rows).

    Once this rank has given up on a peer (error slot set, or a wait here fails) the program pushes
    nothing, raises no flag and computes no tile that depends on a peer: the peers then time out
    and report rather than take rows from a rank that is no longer in step."""
    epoch = work_queue.call_number(queue_ptr)
    ok = True  # a bool (the interpreter types a bare comparison as an integer, which no mask takes)
    ok = ok & rma.no_error(error_ptr)
    half = (epoch % halves).to(tl.int64) * (world - 1) * slot_stride
    row_blocks = tl.cdiv(rows, BLOCK_M)
    pid = tl.program_id(0)
    if (pid < pushers) & ok:
        for job in range(pid, (world - 1) * row_blocks, pushers):
            peer = (rank + 1 + job // row_blocks) % world
            rb = job % row_blocks
            slot = (rank - peer - 1 + world) % world  # mine, in the peer's heap
            there = rma.translate(gathered_ptr + half + slot * slot_stride, rank, peer, heap_bases)
            copy_rows(a_ptr, there, rb * BLOCK_M, rows, K, BLOCK_M, PUSH_COLS)
            rma.signal_set(flags_ptr + slot * flag_stride + rb, epoch, rank, peer, heap_bases)

    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = row_blocks * tiles_n
    k_blocks = tl.cdiv(K, BLOCK_K)
    item = work_queue.next_item(queue_ptr)
    while item < world * per_shard:
        shard = item // per_shard
        pid_m, pid_n = tile_coords(item % per_shard, row_blocks, tiles_n, GROUP_M)
        src = (rank - shard + world) % world
        if shard == 0:
            a = a_ptr
            ready = ok
        else:
            slot = (src - rank - 1 + world) % world
            a = gathered_ptr + half + slot * slot_stride
            chunk = pid_m * BLOCK_M // chunk_rows
            ready = ok & rma.signal_wait(flags_ptr + slot * flag_stride + chunk, epoch, rank, src, heap_bases,
                                         error_ptr, max_spins)
            ok = ready
        if ready:
            acc = gemm_tile(a, b_ptr, pid_m, pid_n, rows, N, K, 0, k_blocks, K, 1, stride_bk, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET, False, False)
            c_shard = c_ptr + src.to(tl.int64) * rows * N
            store_tile(c_shard, c_shard, acc, pid_m, pid_n, rows, N, N, 1, BLOCK_M, BLOCK_N, False, False)
            if GATHER:
                if pid_n == 0:
                    copy_rows(a, full_ptr + src.to(tl.int64) * rows * K, pid_m * BLOCK_M, rows, K, BLOCK_M,
                              PUSH_COLS)
        item = work_queue.next_item(queue_ptr)
    work_queue.finish_call(queue_ptr, epoch)
