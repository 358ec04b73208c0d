"""The heap's error slot: where a kernel whose bounded wait gave up says why, and where the host sets
the bound. One layout for both sides, kept with the kernels that write it (kernels/rma.py wraps these
as constexprs): SymmetricHeap allocates the slot first in every heap, and the host reads a record
into an exception (tp_overlap_plugin/error_slot.py, `heap.check`).

The slot is ERR_WORDS int64 words. Word ERR_CODE is 0 while every wait succeeded; a kernel that gives up
claims it (-1), fills the record words, then publishes its code. ERR_TIMEOUT_NS is no error: the wait
bound in ns, written by the host, read by every wait.

Plain ints, no Triton: the host imports this before it decides whether Triton runs interpreted.
"""

# word offsets
ERR_CODE = 0          # 0: no failure; else one of the codes below
ERR_RANK = 1          # the rank whose wait gave up
ERR_PEER = 2          # the peer it waited for
ERR_FLAG_OFFSET = 3   # the flag's offset in the heap
ERR_EXPECTED = 4      # the epoch it waited for
ERR_SEEN = 5          # the value it saw last
ERR_BOUND_NS = 6      # the bound in ns that wait had (the host may have set another since)
ERR_TIMEOUT_NS = 7    # the wait bound in ns (set by the host)
ERR_WORDS = 8

# codes (word ERR_CODE)
ERR_STUCK = 1         # a wait gave up: the peer never set the flag
