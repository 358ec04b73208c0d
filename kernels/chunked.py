"""The signals of the chunked fused ops (tp_overlap_plugin/ops/chunked.py), whose GEMMs are the vendor
library's (cuBLAS, hipBLASLt) one per chunk, and whose data moves by the copy engine (torch's copy_
from a peer's heap): these kernels only say "ready" and wait for it, on one program each, and sum
GEMM-RS's partials.

Why a second design beside the one-launch fused ops (kernels/ag_gemm.py, gemm_rs.py): inside the
engine's prefill step those ran at the sum of their GEMM and their transfer, not the larger of the
two (bench/notes/prefill.md), their Triton tiles by pointer cost 1.05-1.4x the vendor's, and pushes
by SM stores took SMs from the GEMMs beside them. Here no SM moves data.

The protocol, per op instance ("pool") and rank, in the heap:
- `send`: what my peers pull from me (AG: my shard; RS: my product's rows for each peer);
- `ready[src]`: the last call in which rank src's send slot for me was complete (src writes it into
  my heap, releasing, system scope, after the slot's writes: one kernel after them in its stream);
- `pulled[dst]`: the last call whose pull from my send slot rank dst has finished (dst writes it);
- `calls[0]`: this pool's calls begun on this rank (device memory: graph replays count too).
A call e begins with a wait until every peer pulled call e - 1 (so `send` is free), then writes
`send`, raises `ready`; a puller waits (acquiring) until ready[src] >= e, its stream copies src's
slot with the copy engine, and a kernel after the copies raises `pulled`. One send slot, not two
by call parity: the slot's address is in the copies a CUDA graph captures, so the parity would be
the capture's, not the replay's. The wait for `pulled` is normally met long before it runs (a
peer pulls right after my signal, one or more ops before my next call of the pool).
**Launch order is part of the protocol.** A wait here spins in its own kernel while the host goes on
launching others, and CUDA loads a kernel lazily at its first launch (torch sets
CUDA_MODULE_LOADING=LAZY); a load may wait for every running kernel of the context, the spinning
wait included. So a rank whose host launched a wait and then a first-time cuBLAS kernel stops
launching until the wait ends; if the signal that wait needs is launched by a peer after the same
kind of load, both wait for the bound (H200x4, 2026-11-27: GEMM-RS signalled after each block's GEMM,
with the pulls' waits launched first, gave up on its first call at every rank). The rule that
avoids it: every signal of a call is launched before any wait of that call, and a signal's kernel
depends only on work launched before it. Then each wait's signal was launched, and loaded, before
the wait began, and a load behind a wait only delays the host. The one-launch fused ops have no such
rule to keep: their waits and pushes are one kernel.

Waits are bounded (rma.signal_wait). A wait that gives up records rank, peer and flag in the error
slot (the host raises it), and from then on the rank's outputs are NaN where a peer's data went into
them, never a stale call's data: the RS sum writes NaN for a rank whose wait gave up, and AG ends
with one kernel that, after a give-up, writes NaN over the peers' rows of its product. The NaN goes
into my own output, after everything that wrote it. The first design filled the peer's send slot
before the copy; that raced with the peer writing its slot when the peer was alive (H200x4,
2026-11-28: a live peer's rows came through in a call after a give-up), and wrote into the data a
healthy pair of ranks shared. Filling each landed block after its copy instead (by the next kernel
on the pull stream) held every block's GEMM back behind the next peer's wait (the 8192-token step
1.168x -> 1.138x stock in one measurement).
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma
from tp_overlap_plugin.kernels.all_reduce import poison


@triton.jit
def begin_call_kernel(pulled_ptr, calls_ptr, rank, heap_bases, error_ptr, WORLD: tl.constexpr,
                      POLL_LOAD: tl.constexpr):
    """One program, first in a call: advance calls[0] to this call's number e, and wait until every
    peer has pulled what I sent in call e - 1 (my send slot is free to write)."""
    e = tl.load(calls_ptr) + 1
    tl.debug_barrier()  # every thread loaded the old number before any stores the new one
    tl.store(calls_ptr, e)
    ok = True
    ok = ok & rma.no_error(error_ptr)
    if ok:
        peers, is_peer = rma.peer_ranks(rank, WORLD)
        ok = ok & rma.signal_wait_ranks(pulled_ptr, peers, is_peer, e - 1, rank, heap_bases, error_ptr, POLL_LOAD)


@triton.jit
def signal_kernel(flags_ptr, calls_ptr, rank, heap_bases, error_ptr, dst, WORLD: tl.constexpr):
    """One program: raise my word of `flags_ptr` (ready or pulled) in `dst`'s heap (dst < 0: every
    peer's) to this call's number, after everything before it in my stream. A rank whose wait gave
    up signals nothing: its peers then give up too, rather than pull what it never finished."""
    e = tl.load(calls_ptr)
    if rma.no_error(error_ptr):
        peers, is_peer = rma.peer_ranks(rank, WORLD)
        every_peer = (peers * 0 + dst) < 0  # a block, not a scalar: the interpreter types a scalar comparison as an int
        rma.signal_ranks(flags_ptr + rank, e, rank, peers, is_peer & (every_peer | (peers == dst)), heap_bases)


@triton.jit
def wait_ready_kernel(ready_ptr, calls_ptr, src, rank, heap_bases, error_ptr):
    """One program: wait until `src` has raised my ready word to this call's number; nothing if a
    wait of this rank gave up before (its outputs are NaN from then on, as the one-launch ops' are)."""
    e = tl.load(calls_ptr)
    if rma.no_error(error_ptr):
        rma.signal_wait(ready_ptr + src, e, rank, src, heap_bases, error_ptr)


@triton.jit
def nan_if_failed_kernel(out_ptr, numel, keep_start, keep_end, error_ptr, BLOCK: tl.constexpr):
    """AG's last kernel, one program: if a wait of this rank gave up, NaN over `numel` elements at
    `out_ptr` but [keep_start, keep_end) (my own rows, which need no peer); else nothing. Only a
    give-up runs the fill, so one program is enough."""
    if tl.load(error_ptr) != 0:
        offs = tl.arange(0, BLOCK)
        for i in range(0, numel, BLOCK):
            o = i + offs
            poison(out_ptr, o, (o < numel) & ((o < keep_start) | (o >= keep_end)))


@triton.jit
def reduce_rows_kernel(own_ptr, landed_ptr, out_ptr, rows, N, slot_stride, rank, error_ptr,
                       WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """GEMM-RS's sum: out[rows, N] = the W partials of my rows summed in rank order 0..W-1 in fp32, so
    the result does not depend on arrival order. My own partial is `own_ptr` [rows, N]; the one
    pulled from rank (rank - 1 - j) mod W is landed slot j, [rows, N] at j * slot_stride. NaN
    everywhere if a wait of this rank gave up (its pulls may hold NaN or nothing of this call)."""
    failed = tl.load(error_ptr) != 0
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tl.cdiv(rows, BLOCK_M) * tiles_n, tl.num_programs(0)):
        r = ((tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        c = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (r < rows)[:, None] & (c < N)[None, :]
        offs = r[:, None] * N + c[None, :]
        acc = tl.full((BLOCK_M, BLOCK_N), -0.0, tl.float32)  # -0.0 + v == v, signed zeros included
        for s in tl.static_range(WORLD):
            p = landed_ptr + tl.cast((rank - 1 - s + WORLD) % WORLD, tl.int64) * slot_stride + offs
            if s == rank:
                p = own_ptr + offs
            acc += tl.load(p, mask=mask, other=0.0).to(tl.float32)
        if failed:
            acc = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
