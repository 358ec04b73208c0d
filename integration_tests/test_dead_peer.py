"""A rank dies while its peers run a collective. Every survivor raises RankTimeoutError naming the
dead rank, after the time bound (TP_OVERLAP_HEAP_TIMEOUT_S, set small here) and not a hang. After
that, the survivors' collectives give up at once instead of spinning again, raise at the next check,
and write NaN wherever they could not produce a result: never stale or uninitialised memory that
could pass for one (outputs start as zeros here)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tp_overlap_plugin.heap import RankTimeoutError
from tp_overlap_plugin.multirank import RankExited, run_ranks

DEAD = 1                                        # not rank 0, whose number an unset error word would give
EXIT_CODE = 17
TIMEOUT_S = {"cpu": 2.0, "cuda": 1.0}
OPS = ("all_reduce", "ag_gemm", "gemm_rs", "gemm_all_reduce", "chunked_ag", "chunked_rs")
LATER_BOUND_S = 90  # the wait bound while the later calls run
LATER = OPS + ("all_reduce_norm",)  # run after the first failure too (they give up at once)
# ops whose output is checked: those that take `out` everywhere; on a GPU (where an op returns
# before the error is read) all of them
POISONED = {"cpu": ("all_reduce", "gemm_all_reduce", "all_reduce_norm"), "cuda": LATER}


def _build(ctx):
    """Every op of this test, set up collectively; each entry runs it once and returns its output."""
    from tp_overlap_plugin.ops.all_reduce import HeapAllReduce
    from tp_overlap_plugin.ops.all_reduce_norm import HeapAllReduceNorm
    from tp_overlap_plugin.ops.ag_gemm import AllGatherGemm
    from tp_overlap_plugin.ops.chunked import ChunkedAllGatherGemm, ChunkedGemmReduceScatter
    from tp_overlap_plugin.ops.gemm_ar import GemmAllReduce
    from tp_overlap_plugin.ops.gemm_rs import GemmReduceScatter

    h, W, r, dev = ctx.heap, ctx.world_size, ctx.rank, ctx.device
    dtype = torch.float16 if dev.type == "cpu" else torch.bfloat16
    ar = HeapAllReduce(h, max_bytes=128 << 10)
    ag = AllGatherGemm(h, max_rows=8, k=32, dtype=dtype)
    rs = GemmReduceScatter(h, max_rows=8, n=16, dtype=dtype)
    gar = GemmAllReduce(h, max_rows=8, n=48, dtype=dtype)
    norm = HeapAllReduceNorm(h, hidden=48, max_rows=8, dtype=dtype)
    chunked_ag = ChunkedAllGatherGemm(h, max_rows=8, k=32, dtype=dtype)
    chunked_rs = ChunkedGemmReduceScatter(h, max_rows=8, n=16, dtype=dtype)
    gen = torch.Generator().manual_seed(r)
    # 80 KB: ten 8 KB chunks, more than the CPU grid's four programs, so programs own several
    x = torch.randn(20_480, generator=gen).to(dev)
    a = torch.randn(8, 32, generator=gen).to(dtype).to(dev)
    a_rs = torch.randn(8 * W, 32, generator=gen).to(dtype).to(dev)
    b = torch.randn(32, 16, generator=gen).to(dtype).to(dev)
    w = torch.randn(48, 32, generator=gen).to(dtype).to(dev)  # 3 tiles of 16 columns on the CPU
    y_in = torch.randn(8, 48, generator=gen).to(dtype).to(dev)
    w_norm = torch.ones(48, dtype=dtype, device=dev)

    def gemm_all_reduce():
        y = torch.zeros((8, 48), dtype=dtype, device=dev)
        _last_out["gemm_all_reduce"] = y
        return gar(a, w, out=y)

    def all_reduce():
        y = torch.zeros_like(x)
        _last_out["all_reduce"] = y
        return ar(x, out=y)

    def all_reduce_norm():
        # both outputs: the normalised rows and the new residual
        y, res = torch.zeros((8, 48), dtype=dtype, device=dev), torch.zeros((8, 48), dtype=dtype, device=dev)
        _last_out["all_reduce_norm"] = torch.cat([y, res])
        try:
            return norm(y_in, y_in, w_norm, 1e-6, out=y, residual_out=res)
        finally:
            _last_out["all_reduce_norm"] = torch.cat([y, res])

    def ag_gemm():
        # my own rows need no peer: only the peers' rows of C are checked
        c = _last_out["ag_gemm"] = ag(a, b)
        return c

    def gemm_rs():
        c = _last_out["gemm_rs"] = rs(a_rs, b)
        return c

    def chunked(name, op, x):
        def run():
            c = _last_out[name] = op(x, b)
            return c
        return run

    return {"all_reduce": all_reduce, "ag_gemm": ag_gemm, "gemm_rs": gemm_rs, "gemm_all_reduce": gemm_all_reduce,
            "all_reduce_norm": all_reduce_norm,
            "chunked_ag": chunked("chunked_ag", chunked_ag, a), "chunked_rs": chunked("chunked_rs", chunked_rs, a_rs)}


_last_out = {}  # the ops' latest outputs


def _all_poisoned(ctx, name) -> bool:
    """Whether every element the op could not produce without the dead peer is NaN: for the AGs, every
    peer's rows (a chunked AG that gave up NaNs them all after its GEMMs, the rows it pulled before
    the give-up too: a live peer's slot it pulls after a give-up may hold any call's data)."""
    y = _last_out[name]
    if name in ("ag_gemm", "chunked_ag"):
        rows = y.shape[0] // ctx.world_size
        y = torch.cat([y[:ctx.rank * rows], y[(ctx.rank + 1) * rows:]])
    return bool(torch.isnan(y).all().item())


def _attempt(ctx, op):
    """Run `op` and check the error slot where a caller would (the CPU checks inside every op, a GPU
    at a device sync); (the error's text or None, seconds taken)."""
    t0 = time.monotonic()
    try:
        op()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        ctx.heap.check()
        return None, time.monotonic() - t0
    except RankTimeoutError as e:
        return str(e), time.monotonic() - t0


def _one_rank_dies(ctx, doomed):
    h, dev = ctx.heap, ctx.device
    small = h.timeout_s  # from TP_OVERLAP_HEAP_TIMEOUT_S
    h.timeout_s = 60  # the default: warm-up may include compiles
    ops = _build(ctx)
    for name in LATER:  # every kernel compiled and run on every rank, so no rank waits on a compile
        ops[name]()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    h.check()
    dist.barrier(group=ctx.group)
    if ctx.rank == DEAD:
        os._exit(EXIT_CODE)
    h.timeout_s = small
    for name in LATER:
        _last_out.pop(name, None)
    checked = POISONED[dev.type]
    first = _attempt(ctx, ops[doomed])
    written_first = doomed in checked and not _all_poisoned(ctx, doomed)
    # A long bound for the later calls: one that spun through a wait would take LATER_BOUND_S, far
    # beyond what a call takes on a loaded machine (comparing with the first call's time was not).
    h.timeout_s = LATER_BOUND_S
    later = {name: _attempt(ctx, ops[name]) for name in LATER}
    written_later = [name for name in checked if not _all_poisoned(ctx, name)]
    return {"first": first, "later": later, "written": (written_first, written_later), "timeout": small}


@pytest.mark.parametrize("doomed", OPS)
@pytest.mark.parametrize("world", [2, 4])
def test_survivors_name_the_dead_rank(world, doomed, device):
    results = run_ranks(_one_rank_dies, world, (doomed,), device=device, heap_size=2 << 20,
                        env={"TP_OVERLAP_HEAP_TIMEOUT_S": str(TIMEOUT_S[device])}, may_exit=(DEAD,), timeout=300)
    assert results[DEAD] == RankExited(EXIT_CODE)
    for me, out in enumerate(results):
        if me == DEAD:
            continue
        assert out["timeout"] == TIMEOUT_S[device]
        msg, secs = out["first"]
        assert msg is not None, f"rank {me}: {doomed} with a dead peer raised nothing"
        assert f"rank {me} gave up after {TIMEOUT_S[device]:g} s waiting for rank {DEAD} to set flag" in msg, msg
        assert TIMEOUT_S[device] <= secs < 120, (me, secs)
        for name, (later_msg, later_secs) in out["later"].items():
            # the error slot keeps the first failure; nothing spins through a second bound
            # (naming the bound the first wait had, not LATER_BOUND_S)
            assert later_msg == msg, (me, name, later_msg)
            assert later_secs < LATER_BOUND_S / 2, (me, name, later_secs)
        assert out["written"] == (False, []), (me, out["written"])


CALLS_PER_STEP = 8


def _never(x):
    raise AssertionError("the heap kernel covers this message; the fallback must not run")


def _custom_op_after_a_death(ctx):
    """vLLM's adapter: only `torch.ops.tp_overlap.all_reduce` runs, no heap.check(). As in vLLM's
    step loop, the host syncs once per step (sampled tokens), after several all-reduces."""
    from tp_overlap_plugin import custom_ops
    from tp_overlap_plugin.ops.all_reduce import HeapAllReduce

    h, dev = ctx.heap, ctx.device
    small = h.timeout_s
    h.timeout_s = 60
    key = "test_dead_peer"
    custom_ops.register_all_reduce(key, HeapAllReduce(h, max_bytes=64 << 10), _never)
    x = torch.full((1024,), float(ctx.rank + 1), device=dev)
    y = torch.ops.tp_overlap.all_reduce(x, key)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    assert torch.equal(y, torch.full_like(x, sum(range(1, ctx.world_size + 1))))
    dist.barrier(group=ctx.group)
    if ctx.rank == DEAD:
        os._exit(EXIT_CODE)
    h.timeout_s = small
    for call in range(1, 10 * h.POLL_EVERY):
        try:
            torch.ops.tp_overlap.all_reduce(x, key)
        except RankTimeoutError as e:
            return call, str(e)
        if call % CALLS_PER_STEP == 0 and dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return None, None


@pytest.mark.parametrize("world", [2])
def test_custom_op_raises_for_a_dead_peer(world, device):
    from tp_overlap_plugin.heap import SymmetricHeap
    results = run_ranks(_custom_op_after_a_death, world, device=device, heap_size=2 << 20,
                        env={"TP_OVERLAP_HEAP_TIMEOUT_S": str(TIMEOUT_S[device])}, may_exit=(DEAD,), timeout=300)
    for me, result in enumerate(results):
        if me == DEAD:
            assert result == RankExited(EXIT_CODE)
            continue
        call, msg = result
        assert call is not None, f"rank {me}: the op never reported the dead peer"
        assert f"waiting for rank {DEAD} to set flag" in msg, msg
        # the CPU checks in every call; a GPU poll sees the error once a copy queued after the
        # failed kernel has landed: by the first step boundary after the next copy
        bound = 1 if device == "cpu" else SymmetricHeap.POLL_EVERY + 2 * CALLS_PER_STEP + 1
        assert call <= bound, (me, call, bound)


DIE_AT = 4  # the replay before which the dead rank exits


def _graph_replay_after_a_death(ctx):
    """vLLM's decode: the op only runs inside a captured CUDA graph (two all-reduces in a chain, as
    two layers), replayed once a step, the host waiting for each step's "token" (its own sync).
    Returns (the tokens the host took, the replay that raised, its message)."""
    from tp_overlap_plugin import custom_ops
    from tp_overlap_plugin.ops.all_reduce import HeapAllReduce

    h, dev, W = ctx.heap, ctx.device, ctx.world_size
    small = h.timeout_s
    h.timeout_s = 60
    key = "test_dead_peer_graph"
    custom_ops.register_all_reduce(key, HeapAllReduce(h, max_bytes=64 << 10), _never)
    x = torch.full((1024,), float(ctx.rank + 1), device=dev)
    torch.ops.tp_overlap.all_reduce(x, key)  # eager first: compiled, and the op's stream recorded
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.tp_overlap.all_reduce(torch.ops.tp_overlap.all_reduce(x, key) / W, key)
        token = y.sum()
    graph.replay()
    torch.cuda.synchronize(dev)
    dist.barrier(group=ctx.group)
    h.timeout_s = small  # a device word: the captured kernels read the new bound
    tokens = []
    for step in range(1, 4 * DIE_AT):
        if step == DIE_AT and ctx.rank == DEAD:
            os._exit(EXIT_CODE)
        try:
            graph.replay()
        except RankTimeoutError as e:
            return tokens, step, str(e)
        tokens.append(token.item())
    return tokens, None, None


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2])
def test_graph_replay_surfaces_a_dead_peer_within_one_step(world):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    results = run_ranks(_graph_replay_after_a_death, world, device="cuda", heap_size=2 << 20,
                        env={"TP_OVERLAP_HEAP_TIMEOUT_S": str(TIMEOUT_S["cuda"])}, may_exit=(DEAD,), timeout=300)
    want = 1024.0 * sum(range(1, world + 1))
    for me, result in enumerate(results):
        if me == DEAD:
            assert result == RankExited(EXIT_CODE)
            continue
        tokens, raised_at, msg = result
        assert raised_at == DIE_AT + 1, (me, raised_at, tokens)  # the replay after the failed step
        assert f"waiting for rank {DEAD} to set flag" in msg, msg
        assert tokens[:DIE_AT - 1] == [want] * (DIE_AT - 1), tokens
        # the failed step's output is NaN, not the previous replay's values
        assert len(tokens) == DIE_AT and tokens[-1] != tokens[-1], tokens
