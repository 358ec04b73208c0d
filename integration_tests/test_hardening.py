"""Hazards of the review of issue 25, each reproduced and then closed (see the issue for the list):
64-bit operand offsets in the GEMM core, one op's calls on two streams, a held-back rank at W=3 while two run
ahead of it, and a rank that has given up pushing nothing (AG-GEMM's pushes), the fused all-reduce + norm refusing aliased outputs, and
outputs after a give-up. Waits bounded in time and the dead-peer cases live in test_rma.py and
test_dead_peer.py."""

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
    from tp_overlap_plugin.gemm_config import pick_config
    from tp_overlap_plugin.ops.gemm import gemm
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
    from tp_overlap_plugin.ops.all_reduce import HeapAllReduce
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
    from tp_overlap_plugin.ops.all_reduce_norm import HeapAllReduceNorm
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
    """Every rank runs AG-GEMM call 1; rank HELD's is slow (a wide B), so ranks 0 and 1 push call 2's
    rows while HELD still reads the rows they pushed for call 1, then give up waiting for HELD's call
    2. Their pushes must not land on the rows HELD is reading (call 2 goes to the other half).
    Returns (call 1's output, B, call 2's output or what call 2 raised)."""
    from tp_overlap_plugin.ops.ag_gemm import AllGatherGemm
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
        second = ag(a2[r].to(dev), b.to(dev)).cpu()
    except RankTimeoutError as e:
        second = str(e)
    return c1, b, second


def test_a_held_back_rank_keeps_the_rows_it_reads():
    timeout = 0.5
    results = run_ranks(_held_back, 3, (timeout,), heap_size=1 << 20, timeout=240)
    gen = torch.Generator().manual_seed(11)
    a1, a2 = ([torch.randn(ROWS, K, generator=gen).to(torch.float16) for _ in range(3)] for _ in range(2))
    for r, (c1, b, second) in enumerate(results):
        ref = torch.cat(a1).double() @ b.double()
        err = ((c1.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (r, err)  # call 1 read the rows of call 1, on every rank
        if r != HELD:
            assert isinstance(second, str) and "gave up" in second, (r, second)
        else:  # the others pushed all of call 2's rows before they gave up: HELD's call 2 is whole
            assert not isinstance(second, str), second
            ref = torch.cat(a2).double() @ b.double()
            assert ((second.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_warm_up_covers_every_variant_a_step_can_hit():
    """Every step size up to the budget maps, per rank and op, to a (tile config, row-count class)
    pair that one of the warm-up steps has compiled (serving/worker/runner.py _warm_overlap_shapes)."""
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


# ---- AG-GEMM: a rank that has given up pushes nothing -------------------------------------------

GAVE_UP = 1  # the rank whose error slot says a wait of it gave up
GIVE_UP_SHAPES = [(1, 40, 17), (5, 45, 23)]  # rows per shard (M = 1, ragged), K, N
SENTINEL = 7.0


def _after_a_give_up(ctx, seed):
    """A normal AG-GEMM call on every rank; then rank GAVE_UP's error slot is set as if one of its
    waits had given up, and every rank calls again. GAVE_UP must push nothing (its peers may still
    be reading the half it would write: after a give-up no peer's next call acknowledges it), so
    its slot in the peers' heaps keeps a sentinel; the peers time out naming it, and their rows of
    it are NaN. Returns (the normal outputs, the second call's output, its error, what GAVE_UP's
    slot holds on this rank after the second call)."""
    from tp_overlap_plugin.kernels.error_slot import ERR_CODE, ERR_PEER, ERR_RANK, ERR_STUCK
    from tp_overlap_plugin.ops.ag_gemm import AllGatherGemm
    h, r, W, dev = ctx.heap, ctx.rank, ctx.world_size, ctx.device
    dtype = torch.float16 if dev.type == "cpu" else torch.bfloat16
    ag = {k: AllGatherGemm(h, max_rows=8, k=k, dtype=dtype) for _, k, _ in GIVE_UP_SHAPES}
    outs = []
    for i, (rows, k, n) in enumerate(GIVE_UP_SHAPES):
        a, b = _seq_operands(seed + i, W, rows, k, n)
        outs.append(ag[k](a[r].to(dtype).to(dev), b.to(dtype).to(dev)).cpu())
    rows, k, n = GIVE_UP_SHAPES[-1]
    op = ag[k]
    half = (int(op.calls[1]) + 1) % 2  # the next call's
    if r != GAVE_UP:
        with h.memory_lock():
            op.gathered[half, (GAVE_UP - r - 1) % W].fill_(SENTINEL)
    if r == GAVE_UP:
        h.error[ERR_RANK], h.error[ERR_PEER] = r, (r + 1) % W
        h.error[ERR_CODE] = ERR_STUCK
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    torch.distributed.barrier(group=ctx.group)  # sentinels and the error in place before anyone pushes
    h.timeout_s = 1.0
    h.check_if_free = lambda: None  # the CPU would raise inside the op; the output is checked here
    a, b = _seq_operands(seed + 99, W, rows, k, n)
    c = op(a[r].to(dtype).to(dev), b.to(dtype).to(dev))
    reported = None
    try:
        h.check()
    except RankTimeoutError as e:
        reported = str(e)
    slot = op.gathered[half, (GAVE_UP - r - 1) % W, :rows].cpu() if r != GAVE_UP else None
    return outs, c.cpu(), reported, slot


def _seq_operands(seed, world, rows, k, n):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, k, generator=gen) for _ in range(world)], torch.randn(k, n, generator=gen)


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("world", [3])
def test_a_rank_that_gave_up_pushes_nothing(world, device):
    seed = int(torch.randint(0, 2**30, ()))
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    results = run_ranks(_after_a_give_up, world, (seed,), device=device, heap_size=1 << 20, timeout=300)
    rows, k, n = GIVE_UP_SHAPES[-1]
    a, b = _seq_operands(seed + 99, world, rows, k, n)
    ref = torch.cat(a).to(dtype).double() @ b.to(dtype).double()
    for r, (outs, c, reported, slot) in enumerate(results):
        for i, (rows_i, k_i, n_i) in enumerate(GIVE_UP_SHAPES):
            a_i, b_i = _seq_operands(seed + i, world, rows_i, k_i, n_i)
            want = torch.cat(a_i).to(dtype).double() @ b_i.to(dtype).double()
            assert _rel_err(outs[i], want) < 1e-2, (r, i)
        mine = slice(r * rows, (r + 1) * rows)
        assert _rel_err(c[mine], ref[mine]) < 1e-2, r  # my own rows need no peer
        assert reported is not None, r
        if r == GAVE_UP:
            assert torch.isnan(torch.cat([c[:mine.start], c[mine.stop:]])).all(), r
            continue
        assert torch.equal(slot, torch.full_like(slot, SENTINEL)), (r, slot)  # nothing pushed
        assert f"rank {r} gave up after 1 s waiting for rank {GAVE_UP} to set flag ag_gemm.counts" in reported, reported
        theirs = slice(GAVE_UP * rows, (GAVE_UP + 1) * rows)
        assert torch.isnan(c[theirs]).all(), c[theirs]  # not the sentinel's product, not stale memory
