"""All-reduce over the symmetric heap: one-shot (everyone reads everyone) for small messages,
two-shot (reduce-scatter, then all-gather) for larger ones.

The message is cut into fixed CHUNK_BYTES chunks, and each chunk has its own flags and its own
epoch counter, so a call never waits on work that does not touch its bytes and a program never
needs a grid-wide sync. Per chunk, per call (epoch e):
  1. wait until every peer has finished with this chunk of my heap from its previous use (e-1),
  2. copy my input chunk into my stage and raise ready[chunk, me] = e where it will be read,
  3. reduce: sum staged chunks in rank order 0..W-1 in fp32, so the result is bit-identical on
     every rank and independent of arrival order,
  4. raise done[chunk, me] = e in every peer's heap: they may reuse the chunk.
One-shot: every rank reduces every chunk. Two-shot: chunk c is reduced by its owner c % W, which
publishes the sum in its `result` and raises reduced[chunk]; the others copy it from there.

A wait that gives up stops the program: the chunk it was in is neither written to `out` nor
announced (no ready/done/reduced flag), and the program's remaining chunks are skipped. Peers then
time out on the flags this rank did not raise and report too, instead of reading a stage that
was never filled; the host raises at its next check of the error slot.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma

CHUNK_BYTES = 8192


@triton.jit
def _begin_chunk(x_ptr, stage_ptr, done_ptr, epoch_ptr, chunk, offs, mask, n_flags, rank, world, heap_bases,
                 error_ptr, max_spins):
    epoch = tl.load(epoch_ptr + chunk) + 1
    # Every thread loads the epoch and one stores it: without the barrier a late warp could load the
    # advanced value and wait for an epoch that no peer will raise.
    tl.debug_barrier()
    tl.store(epoch_ptr + chunk, epoch)
    ok = True
    for src in range(world):
        ok = ok & rma.signal_wait(done_ptr + n_flags + src, epoch - 1, rank, src, heap_bases, error_ptr, max_spins)
    tl.store(stage_ptr + offs, tl.load(x_ptr + offs, mask=mask & ok), mask=mask & ok)
    return epoch, ok


@triton.jit
def _sum_staged(stage_ptr, ready_ptr, epoch, offs, mask, rank, world, heap_bases, error_ptr, max_spins,
                BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    ok = True
    for src in range(world):
        ok = ok & rma.signal_wait(ready_ptr + src, epoch, rank, src, heap_bases, error_ptr, max_spins)
        acc += tl.load(rma.translate(stage_ptr, rank, src, heap_bases) + offs, mask=mask & ok).to(tl.float32)
    return acc, ok


@triton.jit
def _end_chunk(done_ptr, epoch, rank, world, heap_bases):
    for peer in range(world):
        rma.signal_set(done_ptr + rank, epoch, rank, peer, heap_bases)


@triton.jit
def one_shot_all_reduce_kernel(x_ptr, out_ptr, stage_ptr, ready_ptr, done_ptr, epoch_ptr, n,
                               rank, world, heap_bases, error_ptr, max_spins, BLOCK: tl.constexpr):
    ok = True
    for chunk in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        if ok:
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            flags = chunk * world
            epoch, ok = _begin_chunk(x_ptr, stage_ptr, done_ptr, epoch_ptr, chunk, offs, mask, flags, rank,
                                     world, heap_bases, error_ptr, max_spins)
            if ok:
                for peer in range(world):
                    rma.signal_set(ready_ptr + flags + rank, epoch, rank, peer, heap_bases)
                acc, ok = _sum_staged(stage_ptr, ready_ptr + flags, epoch, offs, mask, rank, world, heap_bases,
                                      error_ptr, max_spins, BLOCK)
                if ok:
                    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
                    _end_chunk(done_ptr + flags, epoch, rank, world, heap_bases)


@triton.jit
def two_shot_all_reduce_kernel(x_ptr, out_ptr, stage_ptr, result_ptr, ready_ptr, done_ptr, reduced_ptr,
                               epoch_ptr, n, rank, world, heap_bases, error_ptr, max_spins,
                               BLOCK: tl.constexpr):
    ok = True
    for chunk in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        if ok:
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            flags = chunk * world
            owner = chunk % world
            epoch, ok = _begin_chunk(x_ptr, stage_ptr, done_ptr, epoch_ptr, chunk, offs, mask, flags, rank,
                                     world, heap_bases, error_ptr, max_spins)
            if ok:
                rma.signal_set(ready_ptr + flags + rank, epoch, rank, owner, heap_bases)
                if rank == owner:
                    acc, ok = _sum_staged(stage_ptr, ready_ptr + flags, epoch, offs, mask, rank, world,
                                          heap_bases, error_ptr, max_spins, BLOCK)
                    total = acc.to(out_ptr.dtype.element_ty)
                    if ok:
                        tl.store(result_ptr + offs, total, mask=mask)
                        for peer in range(world):
                            rma.signal_set(reduced_ptr + chunk, epoch, rank, peer, heap_bases)
                else:
                    ok = ok & rma.signal_wait(reduced_ptr + chunk, epoch, rank, owner, heap_bases, error_ptr,
                                              max_spins)
                    total = tl.load(rma.translate(result_ptr, rank, owner, heap_bases) + offs, mask=mask & ok)
                if ok:
                    tl.store(out_ptr + offs, total, mask=mask)
                    _end_chunk(done_ptr + flags, epoch, rank, world, heap_bases)
