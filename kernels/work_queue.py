"""A persistent kernel's work queue and call counter, kept in device memory so that a call needs no
state from the host (the fused ops run inside CUDA graphs).

`queue` is three int64 words owned by one op on one rank:
  [0] the next work item of the running call; programs take items in the op's global order, so a
      program held up by a wait or by other work (AG-GEMM's pushes) simply takes fewer items;
  [1] how many programs have finished the running call;
  [2] the number of the last finished call.
The program that finishes last resets [0] and [1] and advances [2]. Every program read [2] before it
counted itself out in [1], so all of a call's programs agree on its number (the epoch its flags carry).
"""

import triton
import triton.language as tl


@triton.jit
def call_number(queue_ptr):
    """This call's epoch: 1 + the last finished call's."""
    return tl.load(queue_ptr + 2) + 1


@triton.jit
def next_item(queue_ptr):
    """The next unclaimed work item (one atomic for the program; every thread gets its result)."""
    return tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")


@triton.jit
def finish_call(queue_ptr, epoch):
    # every thread is past its last use of the queue before the program counts itself out
    tl.debug_barrier()
    finished = tl.atomic_add(queue_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) - 1:
        tl.store(queue_ptr, 0)
        tl.store(queue_ptr + 1, 0)
        tl.store(queue_ptr + 2, epoch)
