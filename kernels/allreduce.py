"""All-reduce over the symmetric heap.

The message is cut into fixed CHUNK_BYTES chunks, and each chunk has its own flags and its own
epoch counter, so a call never waits on work that does not touch its bytes and a program never
needs a grid-wide sync. Per chunk, per call (epoch e):
  1. wait until every peer has finished reading this chunk of my stage in its previous use (e-1),
  2. copy my input chunk into my stage, and raise ready[chunk, me] = e in every peer's heap,
  3. as each peer's ready arrives, read its staged chunk; sum in rank order 0..W-1 so every rank
     gets bit-identical results, in fp32,
  4. raise done[chunk, me] = e in every peer's heap: they may overwrite their stage again.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma

CHUNK_BYTES = 8192


@triton.jit
def one_shot_all_reduce_kernel(x_ptr, out_ptr, stage_ptr, ready_ptr, done_ptr, epoch_ptr, n,
                               rank, world, heap_bases, error_ptr, max_spins,
                               BLOCK: tl.constexpr):
    num_chunks = tl.cdiv(n, BLOCK)
    for chunk in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        epoch = tl.load(epoch_ptr + chunk) + 1
        tl.store(epoch_ptr + chunk, epoch)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        flags = chunk * world
        for src in range(world):
            rma.signal_wait(done_ptr + flags + src, epoch - 1, rank, src, heap_bases, error_ptr, max_spins)
        tl.store(stage_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
        for peer in range(world):
            rma.signal_set(ready_ptr + flags + rank, epoch, rank, peer, heap_bases)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for src in range(world):
            rma.signal_wait(ready_ptr + flags + src, epoch, rank, src, heap_bases, error_ptr, max_spins)
            peer_stage = rma.translate(stage_ptr, rank, src, heap_bases)
            acc += tl.load(peer_stage + offs, mask=mask).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        for peer in range(world):
            rma.signal_set(done_ptr + flags + rank, epoch, rank, peer, heap_bases)
