"""The decode row layer and the RMSNorm after it as one kernel (GemmAllReduceNorm) against a float64
reference of the stock path (each rank's F.linear rounded, summed, + bias, + residual: the new
residual; then layer_ops.rmsnorm's roundings), on real rank processes at 2, 3 and 4 ranks: M = 1, 3
and several row tiles, N not a multiple of the tile, bias, the tile width changing between calls
(the squares slot's reset of stale tile columns), plain GEMM + all-reduce calls interleaved on the
same slots and call counter, repeated calls (both parities), poisoned outputs, bit-identical
results on every rank, and the host op's refusals."""

import pytest
import torch

from tp_overlap_plugin import stats
from tp_overlap_plugin.gemm_config import TileConfig
from tp_overlap_plugin.multirank import gpu_ranks_fit, run_ranks

N, MAX_ROWS, EPS = 37, 20, 1e-5
WIDE = TileConfig(16, 32, 32, 4, 4, 1)  # two tile columns of a row instead of three
# (M, K, bias, config, plain GEMM + all-reduce first): back to back on one op
CASES = [(1, 45, False, None, False), (3, 45, True, WIDE, False), (19, 64, True, None, True),
         (1, 45, False, WIDE, False), (3, 33, False, None, True), (2, 45, True, None, False)]


def _operands(seed, world, m, k, bias):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _ in range(world)]
    ws = [(torch.randn(N, k, generator=g) / k ** 0.5).to(torch.bfloat16) for _ in range(world)]
    b = torch.randn(N, generator=g).to(torch.bfloat16) if bias else None
    residual = (2 * torch.randn(m, N, generator=g)).to(torch.bfloat16)
    norm_w = (1 + 0.2 * torch.randn(N, generator=g)).to(torch.bfloat16)
    return xs, ws, b, residual, norm_w


def _ulp(t):
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(1e-30))) - 7)  # bf16: 7 stored mantissa bits


def _new_residual(xs, ws, b, residual):
    """(the stock path's new residual in float64, the slack per element): each partial may round to
    the neighbouring value (fp32 accumulation in another order), each later rounding an ulp (the
    interpreter truncates fp32 -> bf16)."""
    partials = [x.double() @ w.double().T for x, w in zip(xs, ws)]
    s = sum(p.to(torch.bfloat16).double() for p in partials)
    slack = sum(_ulp(p) for p in partials) + 2 * _ulp(s)
    if b is not None:
        s = s.to(torch.bfloat16).double() + b.double()
        slack = slack + 2 * _ulp(s.abs() + slack)
    h = s.to(torch.bfloat16).double() + residual.double()
    return h, slack + 2 * _ulp(h.abs() + slack)


def _normed(h, norm_w):
    """layer_ops.rmsnorm of the new residual h (bf16), in float64: (h * rstd) rounded, times the weight,
    rounded; either rounding may be an ulp off (fp32 square sums in another order, truncation)."""
    hd = h.double()
    rstd = 1 / torch.sqrt((hd * hd).mean(-1, keepdim=True) + EPS)
    scaled = hd * rstd
    y = scaled.to(torch.bfloat16).double() * norm_w.double()
    return y, 2 * _ulp(scaled) * norm_w.double().abs() + 2 * _ulp(y) + 1e-30


def _run(ctx, seed):
    from tp_overlap_plugin.ops.gemm_ar import GemmAllReduce
    from tp_overlap_plugin.ops.gemm_ar_norm import GemmAllReduceNorm

    gemm_ar = GemmAllReduce(ctx.heap, MAX_ROWS, N, torch.bfloat16)
    op, dev, outs, clean = GemmAllReduceNorm(gemm_ar), ctx.device, [], []
    for i, (m, k, bias, cfg, plain_first) in enumerate(CASES):
        xs, ws, b, residual, norm_w = _operands(seed + i, ctx.world_size, m, k, bias)
        x, w = xs[ctx.rank].to(dev), ws[ctx.rank].to(dev)
        b = b.to(dev) if b is not None else None
        if plain_first:  # the same slots and call counter, one call between two of the fused op's
            plain = gemm_ar(x, w, bias=b)
        normed = torch.full((m, N), float("nan"), dtype=torch.bfloat16, device=dev)  # poisoned
        new_res = torch.full((m, N), float("nan"), dtype=torch.bfloat16, device=dev)
        got = op(x, w, residual.to(dev), norm_w.to(dev), EPS, bias=b, out=normed, residual_out=new_res, config=cfg)
        assert got[0] is normed and got[1] is new_res
        # the squares slot the next call writes and polls is all NOT_YET: no value of an earlier call
        # can read as landed (on a GPU the polls race the writes; here one program writes all first)
        clean.append(bool((op.squares[(int(op.calls[1]) + 1) % 2] == -1).all()))
        outs.append((normed.cpu(), new_res.cpu(), plain.cpu() if plain_first else None))
    ctx.heap.check()
    errors = {}
    x = torch.zeros(MAX_ROWS + 1, 8, dtype=torch.bfloat16, device=dev)
    w = torch.zeros(N, 8, dtype=torch.bfloat16, device=dev)
    r = torch.zeros(2, N, dtype=torch.bfloat16, device=dev)
    nw = torch.ones(N, dtype=torch.bfloat16, device=dev)
    for name, call in {"rows": lambda: op(x, w, torch.zeros(MAX_ROWS + 1, N, dtype=torch.bfloat16), nw, EPS),
                       "residual": lambda: op(x[:2], w, r[:1], nw, EPS),
                       "norm_weight": lambda: op(x[:2], w, r, nw[:5], EPS),
                       "overlap": lambda: op(x[:2], w, r, nw, EPS, residual_out=r)}.items():
        try:
            call()
        except ValueError as e:
            errors[name] = str(e)
    return outs, stats.snapshot(), errors, clean


def _check(name, got, want, slack):
    bad = ~((got.double() - want).abs() <= slack)  # NaN (an unwritten element) is bad too
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.numel()} off; got {got.double()[bad][:4].tolist()} "
                           f"want {want[bad][:4].tolist()}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gemm_all_reduce_norm_matches_stock_path(world, device):
    seed = int(torch.randint(0, 2**30, ()))
    results = run_ranks(_run, world, (seed,), device=device, heap_size=4 << 20, timeout=280)
    for i, (m, k, bias, _, plain_first) in enumerate(CASES):
        xs, ws, b, residual, norm_w = _operands(seed + i, world, m, k, bias)
        normed, new_res, plain = results[0][0][i]
        h, slack = _new_residual(xs, ws, b, residual)
        _check(f"case {i} new residual", new_res, h, slack)
        _check(f"case {i} normed", normed, *_normed(new_res, norm_w))
        if plain is not None:  # the interleaved plain call: the sum before the residual
            _check(f"case {i} plain", plain, h - residual.double(), slack)
        for r in range(1, world):  # one summation order: the same bits on every rank
            assert all(torch.equal(a, b) for a, b in zip(results[r][0][i][:2], (normed, new_res))), (i, r)
    for _, counts, errors, clean in results:
        assert counts["gemm_all_reduce_norm.kernel"] == len(CASES)
        assert clean == [True] * len(CASES), clean
        assert f"max_rows={MAX_ROWS}" in errors["rows"] and "M=21" in errors["rows"]
        assert "residual must be" in errors["residual"] and "(2, 37)" in errors["residual"]
        assert "norm_weight must be" in errors["norm_weight"] and "(37,)" in errors["norm_weight"]
        assert "residual_out overlaps residual" in errors["overlap"]


def _graph_replays(ctx):
    """The fused op captured at M = 1, 7 and 64, each beside a plain GEMM + all-reduce on the same
    slots, the graphs replayed in turn with fresh inputs, against F.linear + NCCL + layer_ops.rmsnorm."""
    from tp_overlap_plugin.kernels import layer_ops
    from tp_overlap_plugin.ops.gemm_ar import GemmAllReduce
    from tp_overlap_plugin.ops.gemm_ar_norm import GemmAllReduceNorm

    dev, g = ctx.device, ctx.device_group
    gen = torch.Generator(device=dev).manual_seed(ctx.rank)
    k, n = 1024, 4096
    gemm_ar = GemmAllReduce(ctx.heap, 64, n, torch.bfloat16)
    op = GemmAllReduceNorm(gemm_ar)
    w = (torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).to(torch.bfloat16)
    norm_w = torch.ones(n, device=dev, dtype=torch.bfloat16)
    graphs = []
    for m in (1, 7, 64):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        res = torch.zeros(m, n, device=dev, dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            op(x, w, res, norm_w, EPS)
            gemm_ar(x, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = op(x, w, res, norm_w, EPS)
            plain = gemm_ar(x, w)
        graphs.append((x, res, outs, plain, graph))
    errs = []
    for i in range(30):
        x, res, (normed, new_res), plain, graph = graphs[i % len(graphs)]
        x.copy_(torch.randn(x.shape, device=dev, generator=gen))
        res.copy_(torch.randn(res.shape, device=dev))
        torch.distributed.broadcast(res, 0, group=g)  # replicated, as the decode layout's residual is
        normed.fill_(float("nan"))
        graph.replay()
        ref = torch.nn.functional.linear(x, w)
        torch.distributed.all_reduce(ref, group=g)
        ref_normed, ref_res = layer_ops.rmsnorm(ref, norm_w, EPS, res)
        errs.append((x.shape[0], max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                     for a, b in ((normed, ref_normed), (new_res, ref_res), (plain, ref)))))
    torch.cuda.synchronize()
    ctx.heap.check()
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_gemm_all_reduce_norm_replays_in_cuda_graphs(world):
    if not gpu_ranks_fit(world):
        pytest.skip(f"needs {world} GPUs")
    for errs in run_ranks(_graph_replays, world, device="cuda", heap_size=16 << 20, timeout=300):
        assert len(errs) == 30 and all(err < 1e-2 for _, err in errs), errs
