"""Device-side remote memory access over the symmetric heap. Every kernel that talks to a peer
goes through these helpers.

One argument order everywhere: the local pointer first, then the value (if any), then `rank` (me),
`peer`, `heap_bases`, then options.

Flags are int64 monotonic epochs with exactly one writer per slot. They are never reset: a waiter
compares against the epoch it expects, so CUDA-graph replays (which advance the epoch in device
memory) and the Triton interpreter (whose atomics are not atomic across processes) are both correct.

Every spin is bounded in wall-clock time: a wait gives up once the heap's timeout (a word of the error
slot, set by the host from `heap_timeout_s`, the same for every world size and poll cost) has passed
since it started, on a device clock (`triton_compat.clock_ns`: %globaltimer on NVIDIA, s_memrealtime
on AMD, the host clock under the interpreter). A wait that gives up records (rank, peer, flag offset,
expected, seen) in the heap's error slot and returns False; later waits on the same rank see the
slot and give up at once, so a dead peer costs one timeout, not one per flag. The host turns the
slot into an exception (SymmetricHeap.check).

A failed wait must stop what depends on it, so its answer drives control flow, and control flow that
holds a CTA barrier must be taken alike by all threads. Triton treats a scalar as uniform without
checking: a scalar volatile load is executed by every thread, each may see a different value, and
nothing reconciles them. A scalar atomic is different: one thread performs it and Triton hands the
result to all threads through shared memory behind a CTA barrier (checked in the compiled code for
sm_90 and gfx942 by test_kernels_compile.py). So `signal_wait` and `no_error` decide on a scalar
atomic read, one round trip for the program, after threads have polled on their own. A wait for a flag
of every peer (`signal_wait_ranks`) and a signal to every peer (`signal_ranks`) take the peers at once,
a thread each, and decide on a reduction every thread receives: a loop over the peers would cost one
round trip after another, a cost that grows with W.
"""

import triton
import triton.language as tl

from tp_overlap_plugin.kernels import error_slot, triton_compat

# the error slot's words and codes: one layout with the host (kernels/error_slot.py)
_ERR_CODE = tl.constexpr(error_slot.ERR_CODE)
_ERR_RANK = tl.constexpr(error_slot.ERR_RANK)
_ERR_PEER = tl.constexpr(error_slot.ERR_PEER)
_ERR_FLAG_OFFSET = tl.constexpr(error_slot.ERR_FLAG_OFFSET)
_ERR_EXPECTED = tl.constexpr(error_slot.ERR_EXPECTED)
_ERR_SEEN = tl.constexpr(error_slot.ERR_SEEN)
_ERR_BOUND_NS = tl.constexpr(error_slot.ERR_BOUND_NS)
_ERR_TIMEOUT_NS = tl.constexpr(error_slot.ERR_TIMEOUT_NS)  # not an error: the wait bound, in ns, set by the host
ERR_STUCK = tl.constexpr(error_slot.ERR_STUCK)

# Defaults of constexpr parameters must be constexpr objects: Triton 3.6 passes a plain str
# default through unwrapped and fails to compile the call.
_ACQ_REL = tl.constexpr("acq_rel")
_SYS = tl.constexpr("sys")

HEAP_ALIGN = tl.constexpr(256)  # heap bases are this far aligned: tp_overlap_plugin/heap.py ALIGN

@triton.jit
def translate(ptr, rank, peer, heap_bases):
    """`ptr` in my heap -> the same offset in `peer`'s heap, as mapped in this process.

    The result is `ptr` moved by the distance between the two heaps, in elements, and that distance
    is declared a multiple of HEAP_ALIGN bytes (SymmetricHeap checks every base). So the translated
    pointer keeps every alignment fact the compiler knew of `ptr`, and peer data moves in the same
    16-byte vectors as local data (rebuilding it from an integer, the compiler assumed 2-byte
    alignment and issued scalar accesses). Translate a scalar base and add offsets afterwards: it
    is one subtraction per program, not per element."""
    elem: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth // 8
    my_base = tl.load(heap_bases + rank)
    peer_base = tl.load(heap_bases + peer)
    return ptr + tl.multiple_of((peer_base - my_base) // elem, HEAP_ALIGN // elem)


@triton.jit
def load(ptr, rank, peer, heap_bases, mask=None, other=None):
    return tl.load(translate(ptr, rank, peer, heap_bases), mask=mask, other=other)


@triton.jit
def store(ptr, value, rank, peer, heap_bases, mask=None):
    tl.store(translate(ptr, rank, peer, heap_bases), value, mask=mask)


@triton.jit
def atomic_add(ptr, value, rank, peer, heap_bases, mask=None, sem: tl.constexpr = _ACQ_REL,
               scope: tl.constexpr = _SYS):
    return tl.atomic_add(translate(ptr, rank, peer, heap_bases), value, mask=mask, sem=sem, scope=scope)


@triton.jit
def atomic_xchg(ptr, value, rank, peer, heap_bases, mask=None, sem: tl.constexpr = _ACQ_REL,
                scope: tl.constexpr = _SYS):
    return tl.atomic_xchg(translate(ptr, rank, peer, heap_bases), value, mask=mask, sem=sem, scope=scope)


@triton.jit
def atomic_cas(ptr, compare, value, rank, peer, heap_bases, sem: tl.constexpr = _ACQ_REL,
               scope: tl.constexpr = _SYS):
    ty = ptr.dtype.element_ty
    return tl.atomic_cas(translate(ptr, rank, peer, heap_bases), tl.cast(compare, ty), tl.cast(value, ty),
                         sem=sem, scope=scope)


@triton.jit
def signal_ranks(flag_ptr, value, rank, ranks, mask, heap_bases):
    """Publish `value` into the flag in the heap of every rank of the block `ranks` under `mask`, after all
    of this program's earlier stores: one releasing atomic per rank, each on its own thread, issued
    together: a loop over the ranks would take one system-scope release and remote round trip after
    another, W - 1 of them for a signal to every peer; this takes one whatever W is. The CTA barrier
    orders every thread's earlier stores before the releasing atomics (cumulativity)."""
    tl.debug_barrier()
    tl.atomic_xchg(translate(flag_ptr, rank, ranks, heap_bases), tl.full(ranks.shape, value, tl.int64), mask=mask,
                   sem="release", scope="sys")


@triton.jit
def peer_ranks(rank, WORLD: tl.constexpr):
    """(ranks, mask): rank + 1, rank + 2, ... of every peer, as a block of W - 1 rounded up to a power of two."""
    j = tl.arange(0, triton.next_power_of_2(max(WORLD - 1, 1)))
    return (rank + 1 + j) % WORLD, j < WORLD - 1


@triton.jit
def timeout_ns(error_ptr):
    """How long a wait may spin, in ns: one word in device memory, so a test or a CUDA graph
    replay takes the current value without a recompile."""
    return tl.load(error_ptr + _ERR_TIMEOUT_NS)


@triton.jit
def no_error(error_ptr):
    """True, alike in every thread, while no wait of this rank has given up."""
    return tl.atomic_add(error_ptr, 0, sem="acquire", scope="gpu") == 0


@triton.jit
def report(flag_ptr, expected, seen, rank, peer, heap_bases, error_ptr, CODE: tl.constexpr):
    """Record, unless an earlier failure of this rank already has, failure CODE about `peer` and
    `flag_ptr` (an address in my heap): the word was `seen` where this rank needed `expected`.
    Called from a branch that every thread of the program takes alike."""
    claim = tl.atomic_cas(error_ptr, tl.cast(0, tl.int64), tl.cast(-1, tl.int64), sem="acq_rel", scope="gpu")
    if claim == 0:
        my_base = tl.load(heap_bases + rank)
        tl.store(error_ptr + _ERR_RANK, rank)
        tl.store(error_ptr + _ERR_PEER, peer)
        tl.store(error_ptr + _ERR_FLAG_OFFSET, flag_ptr.to(tl.int64) - my_base)
        tl.store(error_ptr + _ERR_EXPECTED, expected)
        tl.store(error_ptr + _ERR_SEEN, seen)
        tl.store(error_ptr + _ERR_BOUND_NS, tl.load(error_ptr + _ERR_TIMEOUT_NS))
        tl.atomic_xchg(error_ptr, CODE, sem="release", scope="gpu")


@triton.jit
def report_stuck(flag_ptr, expected, seen, rank, peer, heap_bases, error_ptr):
    """Record that this rank gave up waiting for `peer` to bring `flag_ptr` to `expected`. Every wait
    that gives up (signal_wait, and the waits on data that carries its own arrival mark) calls it."""
    report(flag_ptr, expected, seen, rank, peer, heap_bases, error_ptr, ERR_STUCK)


@triton.jit
def signal_wait(flag_ptr, expected, rank, peer, heap_bases, error_ptr):
    """Wait until my flag (written by `peer`) reaches `expected`. Returns one decision for the program,
    the same in every thread: True when the flag has landed (acquired), False when it gave up at the
    time bound or because an earlier wait of this rank had (the error slot then names the first).

    Threads poll on their own, with volatile loads (the cheapest round trip measured), each with its
    own reading of the clock and no barrier in the loop, so they may leave it at different polls,
    e.g. when the flag lands as the bound is hit. Flags only grow, so one acquiring atomic read
    after the loop, whose result every thread receives, sees at least what any thread saw: that is
    the decision, and its acquire orders the data reads after it. Both branches after it contain
    barriers.
    `expected` must be the same in every thread too: a kernel argument, or a value every thread
    loaded before any thread could change it.

    To mask a block with the result, combine it first (`ok = True` ... `ok = ok & signal_wait(...)`):
    the Triton 3.9 interpreter gives a bare scalar comparison its operands' integer type, and a
    mask broadcast from it is rejected by tl.load/tl.store."""
    timeout = timeout_ns(error_ptr)
    start = triton_compat.clock_ns()
    seen = tl.load(flag_ptr, volatile=True)
    failed = tl.load(error_ptr, volatile=True)
    while (seen < expected) & (failed == 0) & (triton_compat.clock_ns() - start < timeout):
        seen = tl.load(flag_ptr, volatile=True)
        failed = tl.load(error_ptr, volatile=True)
    landed = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    ok = landed >= expected
    if not ok:
        report_stuck(flag_ptr, expected, landed, rank, peer, heap_bases, error_ptr)
    tl.debug_barrier()
    return ok


@triton.jit
def _behind(flags, mask, expected):
    """1 while some flag under `mask` is below `expected`, else 0: one value for the whole program (a
    max-reduction every thread receives), written with the standard max combine as lamport's polls are."""
    return tl.reduce(tl.where(mask & (flags < expected), 1, 0), 0, triton_compat.elementwise_max)


@triton.jit
def _flags_state(ptrs, mask, expected, error_ptr, start, timeout, POLL_LOAD: tl.constexpr):
    """One poll of a block of flags: 0 (all at `expected`), 1 (some behind), 2-3 (past the time bound) or
    4-7 (a wait of this rank gave up before), one value for the whole program. Each thread's clock and
    its reading of the error slot go into the reduction with the flags, so every thread leaves the loop at
    the same poll: the reduction's shuffles and barriers must be met by all of them."""
    # POLL_LOAD ".cv" on CDNA: Triton makes a block load off one base a buffer load there and drops
    # `volatile` on the way; the cache modifier survives and keeps the poll coherent (as lamport's polls)
    seen = tl.load(ptrs, mask=mask, other=0, volatile=True, cache_modifier=POLL_LOAD)
    failed = tl.load(error_ptr, volatile=True)
    late = triton_compat.clock_ns() - start >= timeout
    state = tl.where(mask & (seen < expected), 1, 0) | tl.where(late, 2, 0) | tl.where(failed != 0, 4, 0)
    return tl.reduce(state, 0, triton_compat.elementwise_max)


@triton.jit
def signal_wait_ranks(flags_ptr, ranks, mask, expected, rank, heap_bases, error_ptr, POLL_LOAD: tl.constexpr):
    """signal_wait for my flags of every rank in the block `ranks` under `mask` at once (flag of rank s at
    flags_ptr + s): one poll of all of them at a time, and one acquiring atomic read per flag, each on its
    own thread, after the loop, so a wait for W - 1 peers costs one wait, not W - 1 in a chain. The loop's
    state and the decision after it are reductions every thread receives (`_flags_state`), so all threads
    poll the same number of times and take the same branch. On giving up, the error slot names the lowest
    rank whose flag is behind."""
    ptrs = flags_ptr + ranks
    timeout = timeout_ns(error_ptr)
    start = triton_compat.clock_ns()
    state = _flags_state(ptrs, mask, expected, error_ptr, start, timeout, POLL_LOAD)
    while state == 1:
        state = _flags_state(ptrs, mask, expected, error_ptr, start, timeout, POLL_LOAD)
    landed = tl.atomic_add(ptrs, tl.zeros(ranks.shape, tl.int64), mask=mask, sem="acquire", scope="sys")
    ok = _behind(landed, mask, expected) == 0
    if not ok:
        late = mask & (landed < expected)
        peer = tl.min(tl.where(late, ranks, 1 << 30), axis=0)
        report_stuck(flags_ptr + peer, expected, tl.max(tl.where(late & (ranks == peer), landed, -1), axis=0), rank,
                     peer, heap_bases, error_ptr)
    tl.debug_barrier()
    return ok


@triton.jit
def barrier(flags_ptr, epoch, rank, WORLD: tl.constexpr, heap_bases, error_ptr, POLL_LOAD: tl.constexpr):
    """All WORLD ranks meet at `epoch`. flags_ptr[s] in my heap is written only by rank s.
    A rank that has already given up on a peer does not announce its arrival: its peers then time
    out and report too, rather than run on as if it had reached the barrier."""
    ok = no_error(error_ptr)
    if ok:
        everyone = tl.arange(0, triton.next_power_of_2(WORLD))
        signal_ranks(flags_ptr + rank, epoch, rank, everyone, everyone < WORLD, heap_bases)
        ok = ok & signal_wait_ranks(flags_ptr, everyone, everyone < WORLD, epoch, rank, heap_bases, error_ptr,
                                    POLL_LOAD)
    return ok
