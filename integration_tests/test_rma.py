"""Device RMA API between every pair of ranks, under the Triton interpreter on real processes."""

import pytest
import torch
import triton
import triton.language as tl

from tp_overlap_plugin.kernels import rma
from tp_overlap_plugin.heap import RankTimeoutError
from tp_overlap_plugin.multirank import run_ranks


@triton.jit
def _pairwise_kernel(buf_ptr, counter_ptr, cas_ptr, xchg_ptr, loaded_ptr, rank, world, heap_bases,
                     N: tl.constexpr):
    """Rank r writes row r of every peer's `buf`, adds r+1 to every peer's counter, claims its slot
    of every peer's `cas` array and swaps into its slot of `xchg`; after a barrier (done by the host)
    a second launch reads peers' rows back (see _load_kernel)."""
    offs = tl.arange(0, N)
    for peer in range(world):
        value = (rank * 1000 + peer * 10 + offs).to(tl.float32)
        rma.store(buf_ptr + rank * N + offs, value, rank, peer, heap_bases)
        rma.atomic_add(counter_ptr, rank + 1, rank, peer, heap_bases)
        rma.atomic_cas(cas_ptr + rank, 0, rank + 7, rank, peer, heap_bases)
        rma.atomic_xchg(xchg_ptr + rank, rank + 3, rank, peer, heap_bases, sem="relaxed", scope="gpu")


@triton.jit
def _load_kernel(buf_ptr, loaded_ptr, rank, world, heap_bases, N: tl.constexpr):
    offs = tl.arange(0, N)
    for peer in range(world):
        # row `peer` of peer's own buffer was written by peer into itself
        v = rma.load(buf_ptr + peer * N + offs, rank, peer, heap_bases, mask=offs < N, other=-1.0)
        tl.store(loaded_ptr + peer * N + offs, v)


def _pairwise(ctx):
    h, W, N = ctx.heap, ctx.world_size, 16
    buf = h.alloc((W, N), torch.float32, name="buf")
    counter = h.alloc((1,), torch.int32, name="counter")
    cas = h.alloc((W,), torch.int64, name="cas")
    xchg = h.alloc((W,), torch.int64, name="xchg")
    buf.fill_(float("nan"))
    for t in (counter, cas, xchg):
        t.zero_()
    h.barrier()
    loaded = torch.full((W, N), float("nan"), device=ctx.device)
    _pairwise_kernel[(1,)](buf, counter, cas, xchg, loaded, h.rank, W, h.heap_bases, N=N)
    h.barrier()
    _load_kernel[(1,)](buf, loaded, h.rank, W, h.heap_bases, N=N)
    h.check()
    return buf.cpu(), counter.item(), cas.cpu(), xchg.cpu(), loaded.cpu()


@pytest.mark.parametrize("world", [2, 4])
def test_remote_store_load_atomics_every_pair(world, device):
    results = run_ranks(_pairwise, world, device=device, heap_size=1 << 20, timeout=180)
    N = 16
    ar = torch.arange(N, dtype=torch.float32)
    for me, (buf, counter, cas, xchg, loaded) in enumerate(results):
        for src in range(world):
            torch.testing.assert_close(buf[src], src * 1000 + me * 10 + ar, rtol=0, atol=0)
            # what `me` loaded from peer `src`: row src of src's buffer, written by src itself
            torch.testing.assert_close(loaded[src], src * 1000 + src * 10 + ar, rtol=0, atol=0)
        assert counter == sum(r + 1 for r in range(world))
        assert cas.tolist() == [r + 7 for r in range(world)]
        assert xchg.tolist() == [r + 3 for r in range(world)]


def _many_barriers(ctx, n):
    h = ctx.heap
    for _ in range(n):
        h.barrier()
    return h._barrier_epoch.item(), h._barrier_flags.tolist()


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_barrier_many_epochs(world, device):
    n = 25 if device == "cpu" else 2000
    for epoch, flags in run_ranks(_many_barriers, world, (n,), device=device, heap_size=1 << 20,
                                  timeout=180):
        assert epoch == n
        # each peer's slot holds the last epoch it raised: all arrived at every barrier
        assert flags == [n] * world


def _one_rank_absent(ctx, timeout_s, late_s):
    """Rank W-1 arrives `late_s` seconds late at a barrier (never, for None); the others wait for it at
    most `timeout_s`. Returns (seconds the barrier took, the error or None) on the ranks that came."""
    import time
    ctx.heap.barrier()  # everyone warm (compiled, launched once) so that skew cannot time out
    ctx.heap.timeout_s = timeout_s
    torch.distributed.barrier(group=ctx.group)
    if ctx.rank == ctx.world_size - 1:
        if late_s is None:
            return "skipped the barrier"
        time.sleep(late_s)
    t0 = time.monotonic()
    try:
        ctx.heap.barrier()
        ctx.heap.check()
        return time.monotonic() - t0, None
    except RankTimeoutError as e:
        return time.monotonic() - t0, str(e)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_absent_rank_gives_up_after_the_time_bound(world, device):
    """The bound is wall-clock time, whatever the world size and the cost of a poll."""
    timeout = 1.5
    results = run_ranks(_one_rank_absent, world, (timeout, None), device=device, heap_size=1 << 20, timeout=120)
    for secs, msg in results[:-1]:
        assert f"gave up after {timeout:g} s waiting for rank {world - 1} to set flag " \
               f"host_barrier.flags+{8 * (world - 1)}B" in msg, msg
        assert timeout <= secs < timeout + 10, secs


def test_a_late_rank_within_the_bound_is_waited_for(device):
    """A rank busy for longer than the old poll bound took (2000 polls, ~0.3 s under the interpreter:
    the group died) but less than the time bound, e.g. JIT-compiling a new shape: no one gives up."""
    results = run_ranks(_one_rank_absent, 3, (8.0, 1.5), device=device, heap_size=1 << 20, timeout=120)
    for secs, msg in results:
        assert msg is None, msg
    assert all(secs > 1.0 for secs, _ in results[:-1]), results
