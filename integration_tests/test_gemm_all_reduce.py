"""GEMM + all-reduce (the decode layout's row-parallel layer in one kernel) against a float64
reference of the stock path (each rank's F.linear rounded to the dtype, summed, + bias), on real
rank processes at 2, 3 and 4 ranks: M = 1, M below the world size, M not a tile multiple, odd N
and K, receive tiles of a few rows at a time, bias, fp16 and bf16, M changing from call to call
on one op (slots and call parity reused), poisoned outputs, bit-identical results on every rank,
and the host op's refusals."""

import pytest
import torch

from tp_overlap_plugin import stats
from tp_overlap_plugin.gemm_config import TileConfig
from tp_overlap_plugin.multirank import gpu_ranks_fit, run_ranks

N, MAX_ROWS = 37, 20
# (M, K, dtype, bias, config): one op of N columns serves every case, back to back
CASES = [(1, 45, torch.bfloat16, False, None), (3, 45, torch.bfloat16, True, None),
         (19, 64, torch.bfloat16, False, None), (1, 45, torch.bfloat16, False, None),
         (7, 33, torch.bfloat16, True, None), (2, 45, torch.bfloat16, False, None)]
# 128-column tiles: received 16 rows at a time at 3 ranks, 8 at 4 (TILE_ELEMS // (128 * peers))
WIDE = (19, 45, torch.bfloat16, True, TileConfig(32, 128, 32, 4, 4, 1))
FP16 = [(5, 40, torch.float16, False, None)]


def _cases(world):
    return CASES + ([WIDE] if world > 2 else []) + FP16


def _operands(seed, world, m, k, dtype, bias):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(m, k, generator=g).to(dtype) for _ in range(world)]
    ws = [(torch.randn(N, k, generator=g) / k ** 0.5).to(dtype) for _ in range(world)]
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return xs, ws, b


def _ulp(t, dtype):
    mant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(1e-30))) - mant)


def _reference(xs, ws, b, dtype):
    """(the stock path in float64, how far the kernel may be from it per element): each rank's
    partial may round to the neighbouring value (fp32 accumulation in another order), the sum's and
    the bias add's roundings an ulp each (the interpreter truncates fp32 -> bf16)."""
    partials = [x.double() @ w.double().T for x, w in zip(xs, ws)]
    s = sum(p.to(dtype).double() for p in partials)
    slack = sum(_ulp(p, dtype) for p in partials) + 2 * _ulp(s, dtype)
    if b is not None:
        s = s.to(dtype).double() + b.double()
        slack = slack + 2 * _ulp(s.abs() + slack, dtype)
    return s, slack


def _run(ctx, seed):
    from tp_overlap_plugin.ops.gemm_ar import GemmAllReduce

    ops = {dt: GemmAllReduce(ctx.heap, MAX_ROWS, N, dt) for dt in (torch.bfloat16, torch.float16)}
    dev, outs = ctx.device, []
    for i, (m, k, dtype, bias, cfg) in enumerate(_cases(ctx.world_size)):
        xs, ws, b = _operands(seed + i, ctx.world_size, m, k, dtype, bias)
        out = torch.full((m, N), float("nan"), dtype=dtype, device=dev)  # poisoned: every element written
        got = ops[dtype](xs[ctx.rank].to(dev), ws[ctx.rank].to(dev), bias=b.to(dev) if b is not None else None,
                         out=out, config=cfg)
        assert got is out
        outs.append(out)
    ctx.heap.check()
    outs = [o.cpu() for o in outs]
    op, errors = ops[torch.bfloat16], {}
    x = torch.zeros(MAX_ROWS + 1, 8, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(N, 8, dtype=torch.bfloat16, device=dev)
    for name, call in {"rows": lambda: op(x, w), "dtype": lambda: op(x[:2].half(), w.half()),
                       "shape": lambda: op(x[:2], w[:, :7]), "bias": lambda: op(x[:2], w, bias=w[0])}.items():
        try:
            call()
        except ValueError as e:
            errors[name] = str(e)
    return outs, stats.snapshot(), errors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gemm_all_reduce_matches_stock_path(world, device):
    seed = int(torch.randint(0, 2**30, ()))
    results = run_ranks(_run, world, (seed,), device=device, heap_size=4 << 20, timeout=280)
    for i, (m, k, dtype, bias, _) in enumerate(_cases(world)):
        xs, ws, b = _operands(seed + i, world, m, k, dtype, bias)
        ref, slack = _reference(xs, ws, b, dtype)
        got = results[0][0][i]
        err = (got.double() - ref).abs()
        bad = ~(err <= slack)  # NaN (an unwritten element) is bad too
        assert not bad.any(), (f"case {i} {_cases(world)[i][:4]}: {int(bad.sum())} of {bad.numel()} off; got "
                               f"{got.double()[bad][:4].tolist()} want {ref[bad][:4].tolist()}")
        for r in range(1, world):  # one summation order: the same bits on every rank
            assert torch.equal(results[r][0][i], got), (i, r)
    for _, counts, errors in results:
        assert counts["gemm_all_reduce.kernel"] == len(_cases(world))
        assert f"max_rows={MAX_ROWS}" in errors["rows"] and "M=21" in errors["rows"]
        assert "torch.float16" in errors["dtype"]
        assert "weight must be [n=37, k=8]" in errors["shape"]
        assert "bias" in errors["bias"] and "(37,)" in errors["bias"]


def _graph_replays(ctx):
    """GEMM + all-reduce captured at three Ms (1, below a tile, several tiles), the graphs replayed in
    turn with fresh inputs: the call number (and with it the receive slot) advances in device
    memory, so each replay is a new call and must not read the previous one's pushes."""
    from tp_overlap_plugin.ops.gemm_ar import GemmAllReduce

    W, dev, g = ctx.world_size, ctx.device, ctx.device_group
    gen = torch.Generator(device=dev).manual_seed(ctx.rank)
    k, n = 96, 200
    op = GemmAllReduce(ctx.heap, 64, n, torch.bfloat16)
    w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).to(torch.bfloat16)
    graphs = []
    for m in (1, 7, 64):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            op(x, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(x, w)
        graphs.append((x, out, graph))
    errs = []
    for i in range(30):
        x, out, graph = graphs[i % len(graphs)]
        x.copy_(torch.randn(x.shape, device=dev, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        ref = torch.nn.functional.linear(x, w)
        torch.distributed.all_reduce(ref, group=g)  # the stock path: each rank's partial rounded, summed
        errs.append((x.shape[0], ((out.float() - ref.float()).norm() / ref.float().norm()).item()))
    torch.cuda.synchronize()
    ctx.heap.check()
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gemm_all_reduce_replays_in_cuda_graphs(world):
    if not gpu_ranks_fit(world):
        pytest.skip(f"needs {world} GPUs")
    for errs in run_ranks(_graph_replays, world, device="cuda", heap_size=16 << 20, timeout=300):
        assert len(errs) == 30 and all(err < 1e-2 for _, err in errs), errs
