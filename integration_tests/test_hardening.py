"""Hazards of the review of issue 25, each reproduced and then closed (see the issue for the list):
64-bit operand offsets in the GEMM core, one op's calls on two streams, a held-back rank at W=3 while two run
ahead of it (AG-GEMM's copy-engine push), the fused all-reduce + norm refusing aliased outputs, and
outputs after a give-up. Waits bounded in time and the dead-peer cases live in test_rma.py and
test_dead_peer.py."""

import os
import time

import pytest
import torch
import triton
import triton.language as tl

from tp_overlap_plugin.heap import RankTimeoutError
from tp_overlap_plugin.kernels.gemm import operand_pointers
from tp_overlap_plugin.multirank import run_ranks


@triton.jit
def _offsets_kernel(a_ptr, b_ptr, out_a, out_b, pid_m, pid_n, M, N, k0, stride_am, stride_ak, stride_bk, stride_bn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMM core's operand offsets (in elements) of one tile, stored as int64; nothing is loaded."""
    a_ptrs, b_ptrs = operand_pointers(a_ptr, b_ptr, pid_m, pid_n, M, N, k0, stride_am, stride_ak, stride_bk,
                                      stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)
    esize = a_ptr.dtype.element_ty.primitive_bitwidth // 8
    a_off = (a_ptrs.to(tl.int64) - a_ptr.to(tl.int64)) // esize
    b_off = (b_ptrs.to(tl.int64) - b_ptr.to(tl.int64)) // esize
    tl.store(out_a + tl.arange(0, BLOCK_M)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], a_off)
    tl.store(out_b + tl.arange(0, BLOCK_K)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], b_off)


def _offsets(ctx):
    """A tile far into a 2^36-element A (rows of 2^20) and a B whose K stride is a 152k vocabulary,
    as the pointer path computes them, without allocating either: operands of one element."""
    bm, bn, bk = 16, 16, 16
    M, N, K = 1 << 16, 151_936, 1 << 20
    pid_m, pid_n, k0 = M // bm - 1, N // bn - 2, K - 2 * bk
    a = torch.zeros(1, dtype=torch.bfloat16)
    b = torch.zeros(1, dtype=torch.bfloat16)
    out_a = torch.zeros(bm, bk, dtype=torch.int64)
    out_b = torch.zeros(bk, bn, dtype=torch.int64)
    _offsets_kernel[(1,)](a, b, out_a, out_b, pid_m, pid_n, M, N, k0, K, 1, N, 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    rows = torch.arange(pid_m * bm, pid_m * bm + bm) % M
    cols = torch.arange(pid_n * bn, pid_n * bn + bn) % N
    ks = torch.arange(k0, k0 + bk)
    return out_a, rows[:, None] * K + ks[None, :], out_b, ks[:, None] * N + cols[None, :]


def _single_rank(ctx):
    return _offsets(ctx), _aliased_norm(ctx)


@pytest.fixture(scope="module")
def single_rank():
    """The one-rank checks, run in one interpreter process (a process costs seconds to start)."""
    return run_ranks(_single_rank, 1, heap_size=1 << 20, timeout=120)[0]


def test_operand_offsets_are_64_bit(single_rank):
    """Row index x row stride passes 2^31 for an operand of 2^31 elements (a 16384-token step against
    a 152k vocabulary); int32 products wrapped to a wrong address."""
    got_a, want_a, got_b, want_b = single_rank[0]
    assert want_a.max() > 2**31 and want_b.max() > 2**31
    assert torch.equal(got_a, want_a)
    assert torch.equal(got_b, want_b)


@pytest.mark.gpu
def test_gemm_with_more_than_2_31_elements_in_a():
    """M * K > 2^31 through the pointer path (and the table's config), checked on rows at both ends."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from tp_overlap_plugin.overlap import gemm, pick_config
    import dataclasses
    dev = torch.device("cuda", 0)
    m, k, n = 139_264, 16_384, 64            # A: 2.28e9 elements (4.6 GB of bf16)
    gen = torch.Generator(device=dev).manual_seed(5)
    a = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    a.normal_(generator=gen)
    b = torch.randn(k, n, dtype=torch.bfloat16, device=dev, generator=gen)
    cfg = pick_config(m, n, k, dev)
    for config in (dataclasses.replace(cfg, tma=False, c_tma=False, device_desc=False, warp_spec=False), cfg):
        c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
        gemm(a, b, out=c, config=config)
        for rows in (slice(0, 64), slice(m - 64, m), slice(m // 2, m // 2 + 64)):
            ref = a[rows].double() @ b.double()
            err = ((c[rows].double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (config, rows, err)
    del a


def _two_streams(ctx, calls):
    """Calls of one all-reduce alternate between two streams with no sync between them, each
    stream's inputs written on that stream: every result must still be its call's sum."""
    from tp_overlap_plugin.collectives import HeapAllReduce
    ar = HeapAllReduce(ctx.heap, max_bytes=64 << 10)
    dev = ctx.device
    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream(dev))
    outs = []
    for i in range(calls):
        with torch.cuda.stream(streams[i % 2]):
            # a long kernel first, so that without ordering the other stream's call would overtake
            torch.cuda._sleep(200_000)
            x = torch.full((16384,), float(i * ctx.world_size + ctx.rank + 1), device=dev)
            outs.append(ar(x))
    torch.cuda.synchronize(dev)
    ctx.heap.check()
    return [o.unique().tolist() for o in outs]


@pytest.mark.gpu
def test_one_op_on_two_streams_stays_in_call_order():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    calls, world = 40, 2
    for got in run_ranks(_two_streams, world, (calls,), device="cuda", heap_size=4 << 20, timeout=300):
        assert got == [[float(sum(i * world + r + 1 for r in range(world)))] for i in range(calls)], got


def _aliased_norm(ctx):
    from tp_overlap_plugin.collectives import HeapAllReduceNorm
    dtype = torch.float32
    op = HeapAllReduceNorm(ctx.heap, hidden=64, max_rows=4, dtype=dtype)
    x = torch.randn(4, 64, dtype=dtype, device=ctx.device)
    res = torch.randn(4, 64, dtype=dtype, device=ctx.device)
    w = torch.ones(64, dtype=dtype, device=ctx.device)
    refused = []
    for kwargs in ({"residual_out": x}, {"out": res}, {"residual_out": x[1:3]}):
        try:
            op(x, res, w, 1e-6, **kwargs)
        except ValueError as e:
            refused.append(str(e))
    return refused


def test_fused_norm_refuses_outputs_that_alias_inputs(single_rank):
    refused = single_rank[1]
    assert len(refused) == 3, refused
    assert "residual_out overlaps x" in refused[0] and "out overlaps residual" in refused[1], refused


# ---- AG-GEMM: one rank held back while two run ahead ---------------------------------------------

HELD = 2  # the held-back rank
ROWS, K = 4, 32
N_FAST, N_SLOW = 16, 1024  # rank HELD multiplies by a wide B: its call 1 outlasts the others' bound


def _held_back(ctx, timeout_s):
    """Every rank runs AG-GEMM call 1; rank HELD's is slow (a wide B), so ranks 0 and 1 reach call 2's
    barrier while HELD still reads the rows they pushed for call 1. Their barrier gives up; they must
    not push call 2's rows over the rows HELD is reading. Returns (call 1's output, call 1's A as
    delivered, what call 2 raised)."""
    from tp_overlap_plugin.overlap import AllGatherGemm
    h, r, W, dev = ctx.heap, ctx.rank, ctx.world_size, ctx.device
    dtype = torch.float16
    ag = AllGatherGemm(h, max_rows=ROWS, k=K, dtype=dtype)
    gen = torch.Generator().manual_seed(11)
    a1 = [torch.randn(ROWS, K, generator=gen).to(dtype) for _ in range(W)]
    a2 = [torch.randn(ROWS, K, generator=gen).to(dtype) for _ in range(W)]
    b = torch.randn(K, N_SLOW if r == HELD else N_FAST, generator=gen).to(dtype)
    ag(a1[r].to(dev), b[:, :N_FAST].contiguous().to(dev))  # warm: compiled everywhere, epochs in step
    torch.distributed.barrier(group=ctx.group)
    h.timeout_s = timeout_s
    c1 = ag(a1[r].to(dev), b.to(dev)).cpu()
    try:
        ag(a2[r].to(dev), b.to(dev))
        second = None
    except RankTimeoutError as e:
        second = str(e)
    return c1, b, second


def test_a_held_back_rank_keeps_the_rows_it_reads():
    timeout = 0.5
    results = run_ranks(_held_back, 3, (timeout,), heap_size=1 << 20, timeout=240)
    gen = torch.Generator().manual_seed(11)
    a1 = [torch.randn(ROWS, K, generator=gen).to(torch.float16) for _ in range(3)]
    for r, (c1, b, second) in enumerate(results):
        ref = torch.cat(a1).double() @ b.double()
        err = ((c1.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (r, err)  # call 1 read the rows of call 1, on every rank
        assert second is not None and "gave up" in second, (r, second)


def test_warm_up_covers_every_variant_a_step_can_hit():
    """Every step size up to the budget maps, per rank and op, to a (tile config, row-count class)
    pair that one of the warm-up steps has compiled (serving/runner.py _warm_overlap_shapes)."""
    from tp_overlap_plugin.gemm_config import SMALL_M
    from tp_overlap_plugin.overlap_layers import warm_up_token_counts
    buckets = (16, 128, 1024, 4096)

    def variant(rows):
        bucket = next((b for b in buckets if b >= rows), buckets[-1])
        return bucket, rows <= SMALL_M, rows == 1, rows % 16 == 0

    for world in (2, 3, 4):
        limit = 5000
        warm = warm_up_token_counts(limit, world, buckets)
        assert max(warm) <= limit
        for view in (lambda t: -(-t // world), lambda t: t):  # rows of a sequence-parallel shard; all rows
            compiled = {variant(view(t)) for t in warm}
            missing = sorted({variant(view(t)) for t in range(1, limit + 1)} - compiled)
            assert not missing, (world, missing)


# ---- AG-GEMM: a push of the next call lands while a peer reads (the seqlock) ----------------------

SEQ_SHAPES = [(1, 40, 17), (2, 24, 33), (5, 45, 23)]  # rows per shard (M = 1, M < W, ragged), K, N
OVERRUN = (3, 40, 17)
READER, OVERWRITER = 0, 1  # OVERWRITER's slot in READER's heap is 0: slot = (src - me - 1) mod W


class _Launches:
    """Stands in for overlap.ag_gemm_kernel: every launch first fills C with NaN (so every element
    the kernel fails to write shows), and `before` (if set) runs just before the launch."""

    def __init__(self, kernel):
        self.kernel, self.before, self.last_c = kernel, None, None

    def __getitem__(self, grid):
        def launch(**kwargs):
            kwargs["c_ptr"].fill_(float("nan"))
            self.last_c = kwargs["c_ptr"]
            if self.before is not None:
                self.before()
            return self.kernel[grid](**kwargs)
        return launch


def _overrun(ctx, seed):
    """Normal AG-GEMM calls, then one in which READER, with every peer's flag up for the call, sees
    OVERWRITER's begin word raised to the next call and its rows overwritten before its kernel runs:
    what a push of a rank whose barrier gave up does on a GPU (the copy engine cannot branch).
    Returns (the normal calls' outputs, the overrun call's output, what the heap then reported)."""
    from tp_overlap_plugin import overlap
    h, r, W, dev = ctx.heap, ctx.rank, ctx.world_size, ctx.device
    dtype = torch.float16 if dev.type == "cpu" else torch.bfloat16
    launches = overlap.ag_gemm_kernel = _Launches(overlap.ag_gemm_kernel)
    ag = {k: overlap.AllGatherGemm(h, max_rows=8, k=k, dtype=dtype) for k in (24, 40, 45)}
    normal = []
    for i, (rows, k, n) in enumerate(SEQ_SHAPES):
        a, b = _seq_operands(seed + i, W, rows, k, n)
        normal.append(ag[k](a[r].to(dtype).to(dev), b.to(dtype).to(dev)).cpu())
    rows, k, n = OVERRUN
    op = ag[k]

    def next_call_pushes():
        epoch = int(op.calls[1]) + 1
        deadline = time.monotonic() + 60
        while True:  # every peer's rows of this call have landed
            with h.memory_lock():
                if min(op.flags.tolist()) >= epoch:
                    break
            assert time.monotonic() < deadline, "peers' flags never came up"
            time.sleep(0.005)
        with h.memory_lock():
            op.begin[0] = epoch + 1
        op.gathered[0].fill_(3.0)

    if r == READER:
        launches.before = next_call_pushes
    a, b = _seq_operands(seed + 99, W, rows, k, n)
    reported = None
    try:
        op(a[r].to(dtype).to(dev), b.to(dtype).to(dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        h.check()
    except RankTimeoutError as e:
        reported = str(e)
    return normal, launches.last_c.cpu(), reported


def _seq_operands(seed, world, rows, k, n):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, k, generator=gen) for _ in range(world)], torch.randn(k, n, generator=gen)


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("world", [3])
def test_rows_overwritten_during_the_read_come_out_nan(world, device):
    seed = int(torch.randint(0, 2**30, ()))
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    results = run_ranks(_overrun, world, (seed,), device=device, heap_size=1 << 20, timeout=300)
    for r, (normal, c, reported) in enumerate(results):
        for i, (rows, k, n) in enumerate(SEQ_SHAPES):
            a, b = _seq_operands(seed + i, world, rows, k, n)
            ref = torch.cat(a).to(dtype).double() @ b.to(dtype).double()
            assert normal[i].shape == ref.shape and _rel_err(normal[i], ref) < 1e-2, (r, i, _rel_err(normal[i], ref))
        rows, k, n = OVERRUN
        a, b = _seq_operands(seed + 99, world, rows, k, n)
        ref = torch.cat(a).to(dtype).double() @ b.to(dtype).double()
        if r != READER:
            assert reported is None, (r, reported)
            assert _rel_err(c, ref) < 1e-2, (r, _rel_err(c, ref))
            continue
        bad = slice(OVERWRITER * rows, (OVERWRITER + 1) * rows)
        assert torch.isnan(c[bad]).all(), c[bad]  # not the overwritten rows' product, not stale memory
        kept = torch.ones(world * rows, dtype=torch.bool)
        kept[bad] = False
        assert _rel_err(c[kept], ref[kept]) < 1e-2, _rel_err(c[kept], ref[kept])  # the other shards stand
        epoch = 1 + sum(shape[1] == k for shape in SEQ_SHAPES)  # this op's calls so far, this one included
        assert reported is not None and (f"rank {READER} read rows of rank {OVERWRITER}'s call {epoch} while rank "
                                         f"{OVERWRITER} was already pushing its call {epoch + 1}") in reported, reported
        assert "ag_gemm.begin+0B" in reported, reported
