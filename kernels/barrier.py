"""A whole-group barrier as one tiny kernel: capturable in CUDA graphs because the epoch it waits
for lives in device memory and the kernel itself advances it."""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma


@triton.jit
def barrier_kernel(flags_ptr, epoch_ptr, rank, heap_bases, error_ptr, WORLD: tl.constexpr, POLL_LOAD: tl.constexpr):
    epoch = tl.load(epoch_ptr) + 1
    # Every thread loads the epoch and one stores it: without the barrier a late warp could load the
    # advanced value and wait for an epoch that no peer will raise.
    tl.debug_barrier()
    tl.store(epoch_ptr, epoch)
    rma.barrier(flags_ptr, epoch, rank, WORLD, heap_bases, error_ptr, POLL_LOAD)


def launch_barrier(heap, flags, epoch, poll_load: str = ""):
    """`poll_load`: the flag polls' cache modifier (ops.device.cache_modifiers: ".cv" on CDNA)."""
    barrier_kernel[(1,)](flags_ptr=flags, epoch_ptr=epoch, rank=heap.rank, heap_bases=heap.heap_bases,
                         error_ptr=heap.error, WORLD=heap.world_size, POLL_LOAD=poll_load, num_warps=1)
