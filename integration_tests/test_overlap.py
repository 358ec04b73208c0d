"""The GEMM core, AG-GEMM and GEMM-RS on real rank processes vs float64 references, on shapes that
are not tile multiples, M smaller than the world size, and M = 1; outputs poisoned first; every
shape run twice so epochs and buffer halves advance."""

import dataclasses

import pytest
import torch

from tp_overlap_plugin import stats
from tp_overlap_plugin.multirank import gpu_ranks_fit, run_ranks
from tp_overlap_plugin.gemm_config import pick_config
from tp_overlap_plugin.ops.ag_gemm import AllGatherGemm, PushPlan
from tp_overlap_plugin.ops.gemm import gemm
from tp_overlap_plugin.ops.gemm_rs import GemmReduceScatter


def _rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _operands(seed, world, m_rows, k, n, dtype):
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(m_rows, k, generator=gen).to(dtype) for _ in range(world)]
    b = [torch.randn(k, n, generator=gen).to(dtype) for _ in range(world)]
    return a, b


def delivered(ag, a_shard, rank, world):
    """The whole A as one rank's AG-GEMM call saw it, read right after the call: my shard, and the
    rows each peer's pushers delivered into my heap."""
    rows = a_shard.shape[0]
    return torch.cat([a_shard.cpu() if src == rank else ag.received(src, rows).cpu() for src in range(world)])


def _gemm_cases(ctx, seed):
    errs = []
    for i, (m, k, n) in enumerate([(1, 7, 5), (33, 40, 17), (64, 64, 48), (5, 96, 70)]):
        for dtype in (torch.bfloat16, torch.float16):
            gen = torch.Generator().manual_seed(seed + i)
            a = torch.randn(m, k, generator=gen).to(dtype).to(ctx.device)
            b = torch.randn(k, n, generator=gen).to(dtype).to(ctx.device)
            out = torch.full((m, n), float("nan"), dtype=dtype, device=ctx.device)
            gemm(a, b, out=out)
            bt = b.t().contiguous().t()  # a column-major B: the core takes any B strides
            # the launch variants the config sweep times: flattened tile loop, one program per tile
            variant = dataclasses.replace(pick_config(m, n, k, a.device), flatten=True, persistent=False)
            ref = a.double().cpu() @ b.double().cpu()
            errs.append((dtype, _rel_err(out.cpu(), ref), _rel_err(gemm(a, bt).cpu(), ref),
                         _rel_err(gemm(a, b, config=variant).cpu(), ref)))
    return errs


def test_gemm_core_matches_float64(device):
    for dtype, *errs in run_ranks(_gemm_cases, 1, (int(torch.randint(0, 2**30, ())),), device=device,
                                  timeout=240)[0]:
        assert max(errs) < 1e-2, (dtype, errs)


# rows per shard, K, N, and how the shard is pushed: the default pieces; pieces of 2 rows, 16 columns
# a step (K = 64: several steps); pieces of 4 rows and steps of 32 columns (K = 40: a ragged last
# step) over a shard of two row blocks (two of the op's segments), nine pieces, the last one short
AG_SHAPES = [(1, 40, 17, None), (5, 64, 48, PushPlan(1, 2, 16)), (33, 40, 70, PushPlan(1, 4, 32))]
RS_SHAPES = [(1, 40, 17), (3, 64, 48), (9, 40, 33), (70, 64, 20)]  # M, K, N


def _overlap_cases(ctx, seed, dtype):
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    out = {"ag": [], "rs": []}
    ag = {k: AllGatherGemm(ctx.heap, max_rows=40, k=k, dtype=dtype) for k in (40, 64)}
    for i, (rows, k, n, plan) in enumerate(AG_SHAPES):
        for rep in range(2):
            a, b = _operands(seed + 10 * i + rep, W, rows, k, n, dtype)
            c = ag[k](a[r].to(dev), b[0].to(dev), plan=plan)
            out["ag"].append((rows, k, n, c.cpu(), delivered(ag[k], a[r], r, W)))
    rs = {n: GemmReduceScatter(ctx.heap, max_rows=40, n=n, dtype=dtype) for n in (17, 48, 33, 20)}
    for i, (m, k, n) in enumerate(RS_SHAPES):
        for rep in range(2):
            a, b = _operands(seed + 100 + 10 * i + rep, W, m, k, n, dtype)
            c = rs[n](a[r].to(dev), b[r].to(dev))
            # the exact answer: every rank's partial of my rows from the same GEMM core, tiled the
            # same way (one GEMM per shard), rounded, summed in rank order in fp32
            pad = (-m) % W
            rows = (m + pad) // W
            mine = [torch.cat([a[q], a[q].new_zeros(pad, k)])[r * rows:(r + 1) * rows] for q in range(W)]
            exact = sum(gemm(mine[q].to(dev), b[q].to(dev)).cpu().float() for q in range(W)).to(dtype)
            out["rs"].append((m, k, n, c.cpu(), exact))
    # beyond capacity: the stock path, never a wrong answer
    a, b = _operands(seed + 999, W, 50, 40, 17, dtype)
    big_ag = ag[40](a[r].to(dev), b[0].to(dev)).cpu()
    # rows == max_rows: the gathered rows are a whole slot, which a view would alias; the third call's
    # pushes land in the first call's half
    whole = AllGatherGemm(ctx.heap, max_rows=4, k=40, dtype=dtype)
    kept = []
    for rep in range(3):
        a, b = _operands(seed + 500 + rep, W, 4, 40, 17, dtype)
        whole(a[r].to(dev), b[0].to(dev))
        kept.append(delivered(whole, a[r], r, W))
    out["kept"] = kept
    ctx.heap.check()
    return out, big_ag, stats.snapshot()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ag_gemm_and_gemm_rs(world, device):
    # The interpreter rounds fp32 -> bf16 differently from torch, which would break the bit-exact
    # GEMM-RS check below (not the kernel); fp16 conversions agree. GPUs run bf16.
    seed = int(torch.randint(0, 2**30, ()))
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    results = run_ranks(_overlap_cases, world, (seed, dtype), device=device, heap_size=4 << 20, timeout=600)
    for r, (out, big_ag, counts) in enumerate(results):
        j = 0
        for i, (rows, k, n, _) in enumerate(AG_SHAPES):
            for rep in range(2):
                a, b = _operands(seed + 10 * i + rep, world, rows, k, n, dtype)
                ref = torch.cat(a).double() @ b[0].double()
                _, _, _, c, gathered = out["ag"][j]
                j += 1
                assert c.shape == (world * rows, n)
                assert _rel_err(c, ref) < 1e-2, ("ag", rows, k, n, rep, _rel_err(c, ref))
                assert torch.equal(gathered, torch.cat(a))
        j = 0
        for i, (m, k, n) in enumerate(RS_SHAPES):
            for rep in range(2):
                a, b = _operands(seed + 100 + 10 * i + rep, world, m, k, n, dtype)
                full = sum(a[q].double() @ b[q].double() for q in range(world))
                pad = (-m) % world
                full = torch.cat([full, full.new_zeros(pad, n)])
                rows = (m + pad) // world
                _, _, _, c, exact = out["rs"][j]
                j += 1
                assert c.shape == (rows, n)
                ref = full[r * rows:(r + 1) * rows]
                assert _rel_err(c, ref) < 1e-2, ("rs", m, k, n, rep, _rel_err(c, ref))
                assert torch.equal(c, exact), ("rs not bit-exact", m, k, n, rep)
        a, b = _operands(seed + 999, world, 50, 40, 17, dtype)
        assert _rel_err(big_ag, torch.cat(a).double() @ b[0].double()) < 1e-2
        for rep, gathered in enumerate(out["kept"]):
            assert torch.equal(gathered, torch.cat(_operands(seed + 500 + rep, world, 4, 40, 17, dtype)[0])), rep
        assert counts["ag_gemm.kernel"] == 2 * len(AG_SHAPES) + 3
        assert counts["gemm_rs.kernel"] == 2 * len(RS_SHAPES)
        assert counts["ag_gemm.fallback"] == 1


RANDOM_MAX_ROWS = 24


def _random_calls(seed, world):
    """One op instance each, called alternately with M changing every call (1, below W, ragged),
    K and N odd: (op, M, K, N) per call, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    calls = []
    for i in range(8):
        op = "ag" if i % 2 == 0 else "rs"
        most = RANDOM_MAX_ROWS * (1 if op == "ag" else world)  # AG: rows per shard; RS: rows in all
        m = [1, max(world - 1, 1), int(torch.randint(1, most + 1, (), generator=gen))][i % 3]
        calls.append((op, m, 45, 23))
    return calls


def _random_sequence(ctx, seed, dtype):
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    used = ctx.heap.used
    ag = AllGatherGemm(ctx.heap, max_rows=RANDOM_MAX_ROWS, k=45, dtype=dtype)
    rs = GemmReduceScatter(ctx.heap, max_rows=RANDOM_MAX_ROWS, n=23, dtype=dtype)
    # what the ops took against what their heap_bytes() promise (the engine sizes its heap by them)
    took = (ctx.heap.used - used, AllGatherGemm.heap_bytes(W, RANDOM_MAX_ROWS, 45, dtype)
            + GemmReduceScatter.heap_bytes(W, RANDOM_MAX_ROWS, 23, dtype))
    got = []
    for i, (op, m, k, n) in enumerate(_random_calls(seed, W)):
        a, b = _operands(seed + i, W, m, k, n, dtype)
        if op == "ag":
            got.append(ag(a[r].to(dev), b[0].to(dev)).cpu())
        else:
            got.append(rs(a[r].to(dev), b[r].to(dev)).cpu())
    ctx.heap.check()
    return got, stats.snapshot(), took


@pytest.mark.parametrize("world", [3])
def test_fused_ops_with_m_changing_every_call(world, device):
    seed = int(torch.randint(0, 2**30, ()))
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    results = run_ranks(_random_sequence, world, (seed, dtype), device=device, heap_size=4 << 20, timeout=600)
    for r, (got, counts, (took, promised)) in enumerate(results):
        assert took <= promised + 256, (took, promised)  # + the alignment before the first buffer
        for i, (op, m, k, n) in enumerate(_random_calls(seed, world)):
            a, b = _operands(seed + i, world, m, k, n, dtype)
            if op == "ag":  # m rows per shard
                ref = torch.cat(a).double() @ b[0].double()
            else:  # m rows in all, padded to a multiple of W
                full = sum(a[q].double() @ b[q].double() for q in range(world))
                rows = -(-m // world)
                ref = torch.cat([full, full.new_zeros(rows * world - m, n)])[r * rows:(r + 1) * rows]
            assert got[i].shape == ref.shape, (i, op, m)
            assert _rel_err(got[i], ref) < 1e-2, (i, op, m, _rel_err(got[i], ref))
        assert counts["ag_gemm.kernel"] == 4 and counts["gemm_rs.kernel"] == 4, counts


def _graph_replays(ctx):
    """Both fused ops captured at two Ms each, replayed in turn with fresh inputs: the call number
    and buffer half advance in device memory, so every replay is a new call."""
    W, dev, g = ctx.world_size, ctx.device, ctx.device_group
    gen = torch.Generator(device=dev).manual_seed(ctx.rank)
    k, n = 72, 40
    ag = AllGatherGemm(ctx.heap, max_rows=96, k=k)
    rs = GemmReduceScatter(ctx.heap, max_rows=96, n=n)
    b = torch.randn(k, n, device=dev, generator=gen).to(torch.bfloat16)
    graphs = []
    for op, m in (("ag", 1), ("ag", 90), ("rs", W - 1 or 1), ("rs", 190)):
        a = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        fn = (lambda a=a: ag(a, b)) if op == "ag" else (lambda a=a: rs(a, b))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c = fn()
        graphs.append((op, a, c, graph))
    errs = []
    for i in range(24):
        op, a, c, graph = graphs[i % len(graphs)]
        a.copy_(torch.randn(a.shape, device=dev, generator=gen))
        c.fill_(float("nan"))
        graph.replay()
        if op == "ag":
            full = torch.empty(W * a.shape[0], k, dtype=a.dtype, device=dev)
            torch.distributed.all_gather_into_tensor(full, a, group=g)
            ref = full.double() @ b.double()
        else:
            rows = -(-a.shape[0] // W)
            full = torch.zeros(rows * W, n, dtype=torch.float64, device=dev)
            full[:a.shape[0]] = a.double() @ b.double()
            torch.distributed.all_reduce(full, group=g)
            ref = full[ctx.rank * rows:(ctx.rank + 1) * rows]
        errs.append((op, a.shape[0], _rel_err(c, ref)))
    torch.cuda.synchronize()
    ctx.heap.check()
    return errs, ag.calls[1].item(), rs.calls[1].item()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_fused_ops_replay_in_cuda_graphs(world):
    if not gpu_ranks_fit(world):
        pytest.skip(f"needs {world} GPUs")
    for errs, ag_calls, rs_calls in run_ranks(_graph_replays, world, device="cuda", heap_size=64 << 20,
                                              timeout=300):
        assert all(err < 1e-2 for _, _, err in errs), errs
        assert ag_calls == rs_calls == 1 + 1 + 12  # two warm-ups, then 12 replays each
