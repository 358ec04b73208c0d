"""AG-GEMM in one persistent launch: C = all_gather(A_shard) @ B, the gather hidden behind the GEMM.

The copy engine moves the shards (the host enqueues it on a side stream): into each peer's heap, an
8-byte memcpy of the call number into my begin word there, a stream write-value (whose default
flags fence the earlier writes system-wide first, so a peer that sees what follows also sees them),
a memcpy of my rows, another write-value, then an 8-byte memcpy of the call number into my flag
there (a write-value's value is fixed when a graph is captured; the call numbers live in device
memory). No SM is involved, so the GEMM keeps every SM, and nothing the
GEMM's resident programs wait for needs an SM to become free. (The GEMM's own programs pushing was measured as the other
producer: no faster, and it costs SMs and a dynamic schedule; bench/notes/ag_gemm.md.)
A memcpy's destination is fixed when a graph is captured, so the peers' buffers are single, and
`copy_engine_begin_kernel` first has all ranks meet: after it every peer has read the last call's
rows.

The GEMM is two plain tile loops, so the compiler flattens each into one pipelined loop (the next
tile's loads in flight during this tile's epilogue: 10-18% of the GEMM's time on H200,
bench/results/fused-core-h200-2026-11-22): my own rows, which need nothing, then every peer's rows,
shard by shard in the order they reach me (each rank pushes to rank + 1 first), after one wait per
peer between the loops. A wait per chunk inside the loop would end the flattening (measured: the
fused kernels then ran 1.15-1.3x cuBLAS against the flattened core's 1.03-1.07x), and at the M where
the op is used, my own rows take longer than the copy engine needs to bring all the peers' rows
(bench/notes/ag_gemm.md).

Buffers in the heap, per op: `gathered[slot]` holds the rows of the peer whose slot it is
(slot = (src - me - 1) mod W, so W - 1 slots); `flags[slot]` and `begin[slot]` are written by that
peer only: the begin word before the rows (behind a fencing write-value), the flag after them.
The tiles are the one GEMM core's (kernels/gemm.py), by pointer: rows a peer delivers are read with
ordinary loads, which the flag's acquire orders (nothing portable orders tensor-copy reads after it).
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import calls, rma
from tp_overlap_plugin.kernels.gemm import gemm_tile, store_tile, tile_coords


@triton.jit
def copy_engine_begin_kernel(calls_ptr, push_ptr, flags_ptr, rank, world, heap_bases, error_ptr):
    """Before the copy engine pushes call e into the peers' buffers: every rank meets here, after
    its call e - 1 has read them, and e becomes the values the engine copies: push_ptr[1], into the
    begin words, always; push_ptr[0], into the flags, only where the ranks met. A rank that has given
    up leaves the flag value at e - 1, so its peers time out rather than take its rows. The host
    pushes nothing where it can see that (kernels run in order on the CPU; on a GPU, once the error
    has reached the host); a push that goes out anyway raised the begin word to e first, and a peer
    still reading call e - 1's rows sees it move (ag_gemm_kernel)."""
    epoch = calls.call_number(calls_ptr)
    tl.store(push_ptr + 1, epoch)
    if rma.barrier(flags_ptr, epoch, rank, world, heap_bases, error_ptr):
        tl.store(push_ptr, epoch)


@triton.jit
def _shard_tile(a_ptr, b_ptr, c_ptr, src, tile, rows, N, K, row_blocks, tiles_n, k_blocks, stride_bk, stride_bn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, POISON: tl.constexpr = False):
    """Tile `tile` of C's rows from rank src's shard, whose rows `a_ptr` holds ([rows, K]); with
    POISON, NaN instead (rows that never arrived)."""
    pid_m, pid_n = tile_coords(tile, row_blocks, tiles_n, GROUP_M)
    if POISON:
        acc = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
    else:
        acc = gemm_tile(a_ptr, b_ptr, pid_m, pid_n, rows, N, K, 0, k_blocks, K, 1, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET, False, False)
    c_shard = c_ptr + tl.cast(src, tl.int64) * rows * N
    store_tile(c_shard, c_shard, acc, pid_m, pid_n, rows, N, N, 1, BLOCK_M, BLOCK_N, False, False)


@triton.jit
def ag_gemm_kernel(a_ptr, b_ptr, c_ptr, gathered_ptr, rows, N, K, stride_bk, stride_bn, slot_stride,
                   flags_ptr, begin_ptr, calls_ptr, rank, heap_bases, error_ptr,
                   WORLD: tl.constexpr, PEERS_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
                   FLATTEN: tl.constexpr):
    """c[src * rows + i] = (row i of rank src's shard) @ B for every src; a is my shard [rows, K].

    Once this rank has given up on a peer (error slot set, or a wait here fails) the program
    computes no tile of a peer's rows (they may never have arrived): those rows of C are NaN.
    A program that read a peer's rows then checks that peer's begin word (begin_ptr[slot], a
    seqlock): if it has moved past this call, a push of a later call (one whose barrier gave up on a
    GPU, where the copy engine cannot be stopped) may have overwritten the rows during the reads, so
    the program's tiles of that shard become NaN and the error slot says so. Once per program after
    the loops, not per tile: the loop stays one flattened pipeline with no atomic in it, and a
    program pays one round trip for all its peers; the tiles it stored are overwritten before the
    kernel ends, so no reader of C sees them."""
    epoch, ok = calls.begin_call(calls_ptr, error_ptr)
    P = tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    row_blocks = tl.cdiv(rows, BLOCK_M)
    per_shard = row_blocks * tiles_n
    k_blocks = tl.cdiv(K, BLOCK_K)
    for item in tl.range(tl.program_id(0), per_shard, P, flatten=FLATTEN):
        _shard_tile(a_ptr, b_ptr, c_ptr, rank, item, rows, N, K, row_blocks, tiles_n, k_blocks, stride_bk, stride_bn,
                    BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, INTERPRET)
    for peer in tl.static_range(WORLD):
        if peer != rank:
            ok = ok & rma.signal_wait(flags_ptr + (peer - rank - 1 + WORLD) % WORLD, epoch, rank, peer, heap_bases,
                                      error_ptr)
    end = WORLD * per_shard
    if not ok:
        end = per_shard
    for item in tl.range(calls.first_item(per_shard, P), end, P, flatten=FLATTEN):
        src = (rank - item // per_shard + WORLD) % WORLD
        slot = (src - rank - 1 + WORLD) % WORLD
        _shard_tile(gathered_ptr + tl.cast(slot, tl.int64) * slot_stride, b_ptr, c_ptr, src, item % per_shard, rows,
                    N, K, row_blocks, tiles_n, k_blocks, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                    EVEN_K, INTERPRET)
    if ok & (calls.items_in(per_shard, WORLD * per_shard, P) > 0):
        moved, first, seen = rma.moved_past(begin_ptr, epoch, WORLD - 1, PEERS_POW2)
        if moved != 0:
            rma.report(begin_ptr + first, epoch, seen, rank, (rank + first + 1) % WORLD, heap_bases, error_ptr,
                       rma.ERR_OVERWRITTEN)
            for item in range(calls.first_item(per_shard, P), WORLD * per_shard, P):
                src = (rank - item // per_shard + WORLD) % WORLD
                if ((moved >> ((src - rank - 1 + WORLD) % WORLD)) & 1) != 0:
                    _shard_tile(gathered_ptr, b_ptr, c_ptr, src, item % per_shard, rows, N, K, row_blocks, tiles_n,
                                k_blocks, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, INTERPRET,
                                True)
    if not ok:
        for item in range(calls.first_item(per_shard, P), WORLD * per_shard, P):
            _shard_tile(gathered_ptr, b_ptr, c_ptr, (rank - item // per_shard + WORLD) % WORLD, item % per_shard,
                        rows, N, K, row_blocks, tiles_n, k_blocks, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K,
                        GROUP_M, EVEN_K, INTERPRET, True)
    calls.finish_call(calls_ptr, epoch)
