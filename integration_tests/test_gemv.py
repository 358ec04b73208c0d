"""Our GEMV (kernels/gemv.py, host op overlap.gemv) against a float64 reference: 1 to 8 rows, N and
K that are not multiples of the tile (16 x 256), K shorter than one tile, bias, fp16 and bf16,
poisoned outputs, and strided x and out; inputs it does not take are refused with the limit named.
The dispatcher's gemv question on a made-up table."""

import os

import pytest
import torch

from tp_overlap_plugin.dispatch import Dispatcher
from tp_overlap_plugin.overlap import GEMV_MAX_ROWS, gemv, gemv_applies

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
                tol = 2.0 ** (-7 if dtype == torch.bfloat16 else -10) * (ref.abs() + 1e-2) + 1e-4
                err = (out.double().cpu() - ref).abs()
                if not (err <= tol).all():
                    bad.append((n, k, m, bias is not None, err.max().item()))
    return bad


def main():
    for dtype in (torch.bfloat16, torch.float16):
        bad = _check(torch.device("cpu"), SHAPES, dtype)
        assert not bad, (dtype, bad)
    print("gemv ok")


@pytest.mark.timeout(300)
def test_gemv_matches_float64_under_interpreter():
    from tp_overlap_plugin.serving.testing import run_under_interpreter
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
def test_gemv_replays_in_a_cuda_graph():
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 4096, device="cuda", dtype=torch.bfloat16) / 64
    ref = x.double() @ w.double().t()
    out = torch.empty(2, 3072, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv(x, w, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        gemv(x, w, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        x.normal_()
        ref = x.double() @ w.double().t()
        graph.replay()
        torch.cuda.synchronize()
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_gemv_refuses_what_it_does_not_take():
    w = torch.zeros(4, 16, dtype=torch.bfloat16)
    for x, what in ((torch.zeros(GEMV_MAX_ROWS + 1, 16, dtype=torch.bfloat16), "1 <= M <= 8"),
                    (torch.zeros(1, 16, dtype=torch.float32), "16-bit dtype"),
                    (torch.zeros(2, 32, dtype=torch.bfloat16)[:, ::2], "unit stride")):
        assert not gemv_applies(x, w)
        with pytest.raises(ValueError, match=what):
            gemv(x, w)
    with pytest.raises(ValueError, match="bias must be"):
        gemv(torch.zeros(1, 16, dtype=torch.bfloat16), w, torch.zeros(5, dtype=torch.bfloat16))


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
