"""The decode matmul (host op ops.gemv: kernels/gemv.py's FMA stream, or the GEMM core's tiles with
the operands swapped) against a float64 reference: both paths, every M from 1 to 64, N and K that
are not multiples of the tiles, K shorter than one tile, bias, fp16 and bf16, poisoned outputs, and
strided x and out; the same bits from two calls; replays from CUDA graphs; inputs it does not take
are refused with the limit named. The dispatcher's gemv question on a made-up table. gate_up with its
SiLU-mul in the FMA path's epilogue (gemv_silu_mul) against silu(gate) * up in float64, the same way."""

import os

import pytest
import torch

from tp_overlap_plugin.decode_config import DecodeConfig
from tp_overlap_plugin.dispatch import Dispatcher
from tp_overlap_plugin.ops.gemv import GEMV_MAX_ROWS, gemv, gemv_applies, gemv_silu_mul, gemv_silu_mul_applies
from tp_overlap_plugin.tuning.timing import capture_graph

# both paths at explicit configs, whatever the device's table says; the interpreter's tiles are small
# so that a tiny shape has several tiles, K blocks, K slices (split-K) and a K tail
CPU_CONFIGS = [DecodeConfig("fma", 16, 32, 4, 1), DecodeConfig("mma", 16, 32, 4, 1),
               DecodeConfig("mma", 16, 16, 4, 1, split_k=2, persistent=True)]
GPU_CONFIGS = [DecodeConfig("fma", 16, 256, 4, 4), DecodeConfig("mma", 64, 256, 4, 3, tma=True),
               DecodeConfig("mma", 64, 128, 4, 4, tma=True, split_k=0), DecodeConfig("mma", 32, 256, 4, 4),
               DecodeConfig("mma", 16, 256, 4, 4, tma=True, split_k=2, persistent=True)]

# (N, K): odd N, K off the 256 tile, K shorter than one tile, a whole tile, several tiles
SHAPES = [(17, 300), (40, 136), (33, 256), (24, 520), (1, 8)]
GPU_SHAPES = SHAPES + [(3072, 4096), (4099, 7000)]


def _check(device, shapes, dtype, rows=(1, 2, 3, 5, 8)):
    gen = torch.Generator().manual_seed(0)
    bad = []
    for n, k in shapes:
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
        b = torch.randn(n, generator=gen).to(dtype).to(device)
        for m in rows:
            # x as a row slice of a wider buffer: a row stride other than K
            x = torch.randn(m, k + 8, generator=gen).to(dtype).to(device)[:, :k]
            for bias in (None, b):
                ref = x.double().cpu() @ w.double().cpu().t() + (0 if bias is None else bias.double().cpu())
                out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
                gemv(x, w, bias, out=out)
                # each output is one rounding of an fp32 sum: within 2^-8 (bf16) of |ref| plus
                # fp32 accumulation error; the interpreter truncates instead of rounding (2^-7)
                # (the tensor-core path adds a bias after rounding: a second rounding, of |x W^T|)
                xw = (x.double().cpu() @ w.double().cpu().t()).abs() if bias is not None else 0
                tol = 2.0 ** (-7 if dtype == torch.bfloat16 else -10) * (ref.abs() + xw + 1e-2) + 1e-4
                err = (out.double().cpu() - ref).abs()
                if not (err <= tol).all():
                    bad.append((n, k, m, bias is not None, err.max().item()))
    return bad


def _every_m(device, configs, n, k, rows=range(1, GEMV_MAX_ROWS + 1)):
    """Every M with every config that takes it, against float64, each call made twice: same bits."""
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(device)
    xs = torch.randn(GEMV_MAX_ROWS, k, generator=gen).to(torch.bfloat16).to(device)
    bad = []
    for cfg in configs:
        for m in rows:
            if not cfg.takes(m):
                continue
            x = xs[:m]
            ref = x.double().cpu() @ w.double().cpu().t()
            first = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
            again = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
            gemv(x, w, out=first, config=cfg)
            # the FMA path with dependent launch (its first tile peeled off the loop) gives the same bits
            gemv(x, w, out=again, config=cfg, dependent_launch=cfg.path == "fma")
            err = (first.double().cpu() - ref).abs()
            if not (err <= 2.0 ** -7 * (ref.abs() + 1e-2) + 1e-4).all() or not torch.equal(first, again):
                bad.append((cfg.label(), m, err.max().item(), torch.equal(first, again)))
    return bad


def _silu_mul(device, configs, shapes, rows=(1, 2, 3, 5, 8), dtype=torch.bfloat16):
    """gemv_silu_mul against float64 silu(x gate^T) * (x up^T), into poisoned outputs, with and without
    dependent launch (the same bits). One rounding of the fp32 result: 2^-7 relative (the interpreter
    truncates), plus the fp32 sums' error carried through the activation (|gate| + |up| terms)."""
    gen = torch.Generator().manual_seed(2)
    bad = []
    for n, k in shapes:  # n: output columns; the weight is [2n, K]
        w = (torch.randn(2 * n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
        for cfg in configs:
            for m in rows:
                x = torch.randn(m, k + 8, generator=gen).to(dtype).to(device)[:, :k]
                gate, up = (x.double().cpu() @ w.double().cpu().t()).split(n, dim=1)
                ref = torch.nn.functional.silu(gate) * up
                first = torch.full((m, n), float("nan"), dtype=dtype, device=device)
                again = torch.full((m, n), float("nan"), dtype=dtype, device=device)
                gemv_silu_mul(x, w, out=first, config=cfg)
                gemv_silu_mul(x, w, out=again, config=cfg, dependent_launch=True)
                err = (first.double().cpu() - ref).abs()
                tol = 2.0 ** -7 * (ref.abs() + 1e-2) + 1e-4 * (gate.abs() + up.abs() + 1)
                if not (err <= tol).all() or not torch.equal(first, again):
                    bad.append((cfg.label(), n, k, m, err.max().item(), torch.equal(first, again)))
    return bad


def main():
    for dtype in (torch.bfloat16, torch.float16):
        bad = _check(torch.device("cpu"), SHAPES, dtype)
        assert not bad, (dtype, bad)
    # odd N and K; K = 37 leaves a tail in every config's K blocks
    bad = _every_m(torch.device("cpu"), CPU_CONFIGS[:2], 19, 37)
    bad += _every_m(torch.device("cpu"), CPU_CONFIGS[2:], 19, 37, rows=(1, 16, 17, 33, 64))
    bad += _every_m(torch.device("cpu"), CPU_CONFIGS[:1], 19, 20, rows=(1, 3))  # K shorter than one tile
    assert not bad, bad
    # odd output widths, a K tail, K shorter than a tile, and programs of 1 and 8 output columns
    bad = _silu_mul(torch.device("cpu"), [CPU_CONFIGS[0], DecodeConfig("fma", 2, 32, 4, 1)],
                    [(9, 37), (16, 64), (3, 20)], rows=(1, 3, 4))
    bad += _silu_mul(torch.device("cpu"), CPU_CONFIGS[:1], [(9, 37)], rows=(2,), dtype=torch.float16)
    assert not bad, bad
    _tp1_layers_take_the_decode_matmul()
    print("gemv ok")


def _tp1_layers_take_the_decode_matmul():
    """The flag's layers at TP=1 (no heap): column, row and LM head match the stock layers on the same
    weights, through the decode matmul at decode sizes and F.linear above 64 rows."""
    from tp_overlap_plugin import stats
    from tp_overlap_plugin.layers import TPGroup, TPLayers
    from tp_overlap_plugin.options import TPOverlapOptions
    from tp_overlap_plugin.overlap_layers import OverlapTPLayers
    from tp_overlap_plugin.overlap_plan import OverlapPlan

    torch.manual_seed(0)
    dt, tp = torch.bfloat16, TPGroup(0, 1, None)
    plan = OverlapPlan(TPOverlapOptions(), "cpu", 1, dispatcher=Dispatcher(mode="overlap"))
    ours = OverlapTPLayers(tp, dt, "cpu", None, max_tokens=80, plan=plan)
    stock = TPLayers(tp, dt, "cpu")
    mods = []
    for make in (lambda f: f.column(40, [24, 8], bias=True), lambda f: f.row(40, 24, bias=True),
                 lambda f: f.lm_head(50, 40)):
        a, b = make(ours), make(stock)
        for p in a.parameters():
            p.data.copy_(torch.randn(p.shape) / 8)
        b.load_state_dict(a.state_dict())
        mods.append((a, b))
    before = stats.snapshot()
    for m in (1, 17, 80):
        ours.begin_step(m)
        x = torch.randn(m, 40).to(dt)
        for a, b in mods:
            got, ref = (a(x), b(x)) if not hasattr(a, "local_logits") else (a(x, None), b(x, None))
            assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-2, (a, m)
    assert stats.since(before).get("gemv.kernel", 0) == 2 * 3, stats.since(before)


@pytest.mark.timeout(300)
def test_gemv_matches_float64_under_interpreter():
    from serving_helpers import run_under_interpreter
    run_under_interpreter(__file__, "gemv ok", timeout=290)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs real kernels")
def test_gemv_matches_float64_on_gpu():
    for dtype in (torch.bfloat16, torch.float16):
        bad = _check(torch.device("cuda"), GPU_SHAPES, dtype)
        assert not bad, (dtype, bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs real kernels")
def test_gemv_every_m_on_gpu():
    """Every M, every GPU config that takes it, an odd shape (K tail, ragged N): float64 and same bits."""
    bad = _every_m(torch.device("cuda"), GPU_CONFIGS, 1031, 4104)
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs real kernels")
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("m", [2, 16, 64])
@pytest.mark.parametrize("pdl", [False, True], ids=["", "dependent_launch"])
def test_gemv_replays_in_a_cuda_graph(cfg, m, pdl):
    if not cfg.takes(m) or (pdl and cfg.path != "fma"):
        pytest.skip(f"{cfg.label()} does not take {m} rows" if not cfg.takes(m) else "dependent launch: the FMA path")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 4096, device="cuda", dtype=torch.bfloat16) / 64
    out = torch.empty(m, 3072, device="cuda", dtype=torch.bfloat16)
    replay = capture_graph(lambda: gemv(x, w, out=out, config=cfg, dependent_launch=pdl), 1)
    for _ in range(3):
        out.fill_(float("nan"))
        x.normal_()
        ref = x.double() @ w.double().t()
        replay()
        torch.cuda.synchronize()
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
        eager = gemv(x, w, config=cfg)
        assert torch.equal(eager, out), "a replay and an eager call differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs real kernels")
def test_gemv_silu_mul_matches_float64_on_gpu():
    """The FMA configs tune measures (decode_configs), on gate_up's TP=4 and TP=8 shard of Llama-3-8B and an
    odd shape, in a CUDA graph as well as eager."""
    from tp_overlap_plugin.tuning.decode_configs import candidates
    fma = [c for c in candidates("cuda") if c.path == "fma"]
    bad = _silu_mul(torch.device("cuda"), fma, [(3584, 4096), (1792, 4096), (1031, 4104)], rows=(1, 2, 5, 8, 16))
    assert not bad, bad
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 1792, 4096, device="cuda", dtype=torch.bfloat16) / 64
    out = torch.empty(1, 1792, device="cuda", dtype=torch.bfloat16)
    replay = capture_graph(lambda: gemv_silu_mul(x, w, out=out, dependent_launch=True), 1)
    for _ in range(3):
        out.fill_(float("nan"))
        x.normal_()
        replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv_silu_mul(x, w)), "a replay and an eager call differ"


def test_gemv_refuses_what_it_does_not_take():
    w = torch.zeros(4, 16, dtype=torch.bfloat16)
    for x, what in ((torch.zeros(GEMV_MAX_ROWS + 1, 16, dtype=torch.bfloat16), "1 <= M <= 64"),
                    (torch.zeros(1, 16, dtype=torch.float32), "16-bit dtype"),
                    (torch.zeros(2, 32, dtype=torch.bfloat16)[:, ::2], "unit stride")):
        assert not gemv_applies(x, w)
        with pytest.raises(ValueError, match=what):
            gemv(x, w)
    with pytest.raises(ValueError, match="bias must be"):
        gemv(torch.zeros(1, 16, dtype=torch.bfloat16), w, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not take 17 rows"):
        gemv(torch.zeros(17, 16, dtype=torch.bfloat16), w, config=DecodeConfig("fma", 16, 32))
    one = torch.zeros(1, 16, dtype=torch.bfloat16)
    assert gemv_silu_mul_applies(one, w) and not gemv_silu_mul_applies(one, w[:3])
    assert not gemv_silu_mul_applies(torch.zeros(5, 16, dtype=torch.bfloat16), w)  # the table's MMA path on the CPU
    for x, wt, what in ((one, w[:3], "even number of rows"), (torch.zeros(17, 16, dtype=torch.bfloat16), w, "M <= 16")):
        with pytest.raises(ValueError, match=what):
            gemv_silu_mul(x, wt)
    with pytest.raises(ValueError, match="FMA path only"):
        gemv_silu_mul(one, w, config=DecodeConfig("mma", 16, 32))
    with pytest.raises(ValueError, match=r"out must be \[1, 2\]"):
        gemv_silu_mul(one, w, out=torch.zeros(1, 4, dtype=torch.bfloat16))


def test_gemv_rule():
    rows = [{"M": m, "K": 4096, "N": 3072, "winner": w} for m, w in ((1, "gemv"), (2, "gemv"), (4, "gemv"),
                                                                      (8, "stock"))]
    d = Dispatcher(gemv_rows=rows)
    assert [d.gemv(m, 4096, 3072) for m in (1, 2, 3, 4, 5, 8)] == [True, True, True, True, False, False]
    assert not d.gemv(1, 4096, 14336)  # a shape not measured: stock
    assert d.may_use_kernels and not Dispatcher().may_use_kernels
    assert Dispatcher(mode="overlap").gemv(1, 1, 1) and not Dispatcher(mode="stock").gemv(1, 4096, 3072)


if __name__ == "__main__":
    main()
