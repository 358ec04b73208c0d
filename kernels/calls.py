"""A persistent fused op's call counter, in device memory, and how its programs split the items of a
call, so that a call needs no state from the host (the fused ops run inside CUDA graphs).

`calls` is two int64 words owned by one op on one rank: [0] how many programs have finished the
running call, [1] the number of the last finished call. The program that finishes last resets [0]
and advances [1]. Every program read [1] before it counted itself out, so all of a call's programs
agree on its number: the epoch its flags carry.

The work of a call is a sequence of tiles in a few phases (a fused op's own rows, its peers' rows);
program p takes items p, p + P, p + 2P, ... of the whole sequence, so no phase boundary leaves SMs
idle, and each phase's items form a plain loop the compiler can flatten and pipeline (the waits a
phase needs happen before it, not in its loop).
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma


@triton.jit
def call_number(calls_ptr):
    """This call's epoch: 1 + the last finished call's."""
    return tl.load(calls_ptr + 1) + 1


@triton.jit
def begin_call(calls_ptr, error_ptr):
    """(this call's epoch, whether this rank may still talk to its peers: none of its waits gave up)."""
    ok = True  # a bool (the interpreter types a bare comparison as an integer, which no mask takes)
    ok = ok & rma.no_error(error_ptr)
    return call_number(calls_ptr), ok


@triton.jit
def first_item(start, P):
    """My first item at or after `start` (I take the items congruent to my program id modulo P)."""
    return start + (tl.program_id(0) - start % P + P) % P


@triton.jit
def items_in(lo, hi, P):
    """How many of the items lo..hi-1 are mine."""
    return tl.maximum(hi - first_item(lo, P) + P - 1, 0) // P


@triton.jit
def finish_call(calls_ptr, epoch):
    """Returns True in the program that finished the call last (after every other one counted out)."""
    # every thread is past its last use of the call's state before the program counts itself out
    tl.debug_barrier()
    finished = tl.atomic_add(calls_ptr, 1, sem="acq_rel", scope="gpu")
    last = finished == tl.num_programs(0) - 1
    if last:
        tl.store(calls_ptr, 0)
        tl.store(calls_ptr + 1, epoch)
    return last
