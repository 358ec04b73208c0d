"""Symmetric heap: allocation, alignment, scoped release, exhaustion, /dev/shm hygiene."""

import fcntl
import os
import time

import pytest
import torch
import triton
import triton.language as tl

from tp_overlap_plugin.heap import ALIGN, HeapExhaustedError, SymmetricHeap
from tp_overlap_plugin.heap_shm import SHM_PREFIX
from tp_overlap_plugin.multirank import RankFailedError, run_ranks

HEAP = 1 << 20


def _shm_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith(SHM_PREFIX)}


def _allocations(ctx):
    h = ctx.heap
    offsets = []
    for n, dt in [(1, torch.uint8), (3, torch.float16), (1000, torch.float32), (7, torch.int64)]:
        t = h.alloc((n,), dt, name=f"t{n}")
        assert t.data_ptr() % ALIGN == 0
        offsets.append(h.offset_of(t))
    mark = h.used
    with h.scope():
        a = h.alloc((5000,), torch.uint8)
        with h.scope():
            b = h.alloc((100,), torch.float32)
        c = h.alloc((100,), torch.float32)
        assert c.data_ptr() == b.data_ptr()  # the inner scope's space is reused
        assert a.data_ptr() < c.data_ptr()
    assert h.used == mark
    d = h.alloc((5000,), torch.uint8)
    assert d.data_ptr() == a.data_ptr()
    # peers see the same bytes at the same offset
    d.fill_(ctx.rank + 1)
    torch.distributed.barrier(group=ctx.group)
    peer = (ctx.rank + 1) % ctx.world_size
    assert int(h.peer_view(d, peer)[17]) == peer + 1
    with pytest.raises(HeapExhaustedError) as info:
        h.alloc((h.free + 1,), torch.uint8, name="too_big")
    msg = str(info.value)
    used_before = h.used
    h.alloc((16,), torch.uint8)  # a failed allocation loses nothing
    assert h.used > used_before
    return offsets, msg, [h.heap_bases.tolist(), h.backend_name]


def test_alignment_scopes_and_exhaustion():
    before = _shm_files()
    results = run_ranks(_allocations, 2, heap_size=HEAP, timeout=120)
    (off0, msg, (bases, backend)), (off1, _, _) = results
    assert off0 == off1
    assert backend == "shm"
    assert "too_big" in msg and "requested" in msg and "free" in msg and "heap_size" in msg
    assert _shm_files() <= before


def _bad_size(ctx):
    SymmetricHeap(ctx.group, "cpu", heap_size=1000)


def test_bad_heap_size_is_rejected():
    with pytest.raises(RankFailedError, match="multiple of 256 bytes and at least 64 KiB"):
        run_ranks(_bad_size, 2, timeout=60)


def _crash_after_heap(ctx):
    if ctx.rank == 1:
        os._exit(3)
    ctx.heap.barrier()


def _crash_during_heap_setup(ctx):
    # rank 1 dies before the rendezvous: rank 0 has created its file but nobody will map it
    if ctx.rank == 1:
        os._exit(4)
    SymmetricHeap(ctx.group, "cpu", heap_size=HEAP)


def test_shm_files_removed_after_rank_crash():
    before = _shm_files()
    with pytest.raises(RankFailedError, match=r"rank 1 failed:\nprocess exited with code 3|rank 1 had exited with code 3"):
        run_ranks(_crash_after_heap, 2, heap_size=HEAP, heap_kwargs={"timeout_s": 1.0}, timeout=60)
    with pytest.raises(RankFailedError):
        run_ranks(_crash_during_heap_setup, 2, timeout=60)
    # what is new and left must be in use by a live process (another test's ranks, run beside this
    # one): a file of a dead process is a leak
    assert {f for f in _shm_files() - before if not _alive(int(f[len(SHM_PREFIX):].split("-", 1)[0]))} == set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@triton.jit
def _copy_one(src_ptr, dst_ptr):
    tl.store(dst_ptr, tl.load(src_ptr))


def _interpreter_waits_for_the_world_lock(ctx):
    h = ctx.heap
    t = h.alloc((1,), torch.int32, name="t")
    t.fill_(ctx.rank + 7)
    out = torch.zeros(1, dtype=torch.int32)
    lock_fd = h._backend.lock.fd
    torch.distributed.barrier(group=ctx.group)
    if ctx.rank == 0:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # as if a memory operation of this rank were under way
        torch.distributed.barrier(group=ctx.group)
        time.sleep(1.0)
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        return None
    torch.distributed.barrier(group=ctx.group)
    start = time.monotonic()
    _copy_one[(1,)](h.peer_view(t, 0), out)
    return time.monotonic() - start, int(out[0])


def test_interpreter_memory_operations_are_whole_between_ranks():
    """A peer's load through the heap waits while another rank's memory operation holds the world's
    lock: the interpreter's per-element memcpy can then never interleave with a peer's (a torn
    2-byte element, or a late second store over a consumed Lamport slot)."""
    _, (waited, value) = run_ranks(_interpreter_waits_for_the_world_lock, 2, heap_size=HEAP, timeout=120)
    assert value == 7
    assert waited >= 0.8, f"the load did not wait for the lock ({waited:.3f} s)"
