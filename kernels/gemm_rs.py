"""The two small kernels around GEMM-RS's GEMMs (the GEMMs themselves are `gemm_kernel`).

A rank computes each peer's rows with `gemm_kernel` writing straight into that owner's receive
slot `recv[parity, me]`, then `signal_kernel` raises the owner's flag for me. Its own rows go into
its own slot `recv[parity, me]` locally. `reduce_kernel` then waits for every peer's flag and sums
the W slots in rank order 0..W-1 in fp32. Every partial is rounded to the output dtype the same
way and the order is fixed, so the result does not depend on arrival order and is identical on
every rank's view of it.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma


@triton.jit(do_not_specialize=["value"])
def signal_kernel(flag_ptr, value, rank, peer, heap_bases, error_ptr):
    """Set `peer`'s copy of my flag to `value`, after everything this stream did before (the
    launch boundary completes the previous kernel's stores; the release publishes them). Not once
    this rank has given up on a peer: what it would announce may be stale, so the peer is left to
    time out and report. With peer == rank it raises a flag of this process, in the heap or not."""
    if rma.no_error(error_ptr):
        rma.signal_set(flag_ptr, value, rank, peer, heap_bases)


@triton.jit(do_not_specialize=["epoch"])
def reduce_kernel(recv_ptr, out_ptr, flags_ptr, epoch, n, slot_stride, rank, world, heap_bases, error_ptr,
                  max_spins, BLOCK: tl.constexpr):
    """out[:n] = sum over src in 0..W-1 of recv[src, :n], once flags[src] (set by src) reach epoch.
    Writes nothing if a wait fails."""
    ok = True
    for src in range(world):
        if src != rank:
            ok = ok & rma.signal_wait(flags_ptr + src, epoch, rank, src, heap_bases, error_ptr, max_spins)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < n) & ok
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for src in range(world):
        total += tl.load(recv_ptr + tl.cast(src, tl.int64) * slot_stride + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
