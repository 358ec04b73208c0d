"""tp_overlap_plugin/launch.py without a GPU: the direct launches get every parameter in signature
order (the fixed ones and this call's), a call whose arguments Triton would specialise or type
differently goes through Triton again, and a launch hook sends every call through Triton; on a GPU, the direct
launches compute what Triton's do."""

import pytest
import torch
import triton
import triton.language as tl

from tp_overlap_plugin import launch as launch_mod
from tp_overlap_plugin.kernels import triton_compat


@triton.jit
def _kernel(x_ptr, out_ptr, n, scale, rank, WORLD: tl.constexpr, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale + rank + WORLD, mask=offs < n)


class _FakeJit:
    """Stands for the jit function on a GPU: records what Triton's path and the direct path get."""

    def __init__(self):
        self.fn, self.arg_names, self.compiles, self.direct = _kernel.fn, _kernel.arg_names, [], []

    def __getitem__(self, grid):
        def run(**kwargs):
            self.compiles.append((grid, kwargs))
            compiled = type("Compiled", (), {})()
            compiled.function, compiled.packed_metadata = "fn", "meta"
            compiled.run = lambda *a: self.direct.append(a)
            return compiled
        return run


def test_direct_launch_passes_every_parameter_in_signature_order(monkeypatch):
    monkeypatch.setattr(triton_compat, "current_raw_stream", lambda: (lambda index: 1234 + index))
    monkeypatch.setattr(triton_compat, "launch_hooks_active", lambda: False)
    fake = _FakeJit()
    L = launch_mod.Launcher(fake, torch.device("cuda", 1), ("x_ptr", "out_ptr", "n", "scale"), rank=3, WORLD=4,
                            BLOCK=64, num_warps=8)
    x, out = torch.zeros(64), torch.zeros(64)
    L(5, x, out, 48, 0.5)
    assert len(fake.compiles) == 1 and fake.compiles[0][0] == (5,)
    assert fake.compiles[0][1] == {"rank": 3, "WORLD": 4, "BLOCK": 64, "num_warps": 8, "x_ptr": x, "out_ptr": out,
                                   "n": 48, "scale": 0.5}
    L(7, x, out, 32, 2.0)  # same specialisation (n a multiple of 16): no Triton call
    assert len(fake.compiles) == 1
    assert fake.direct == [(7, 1, 1, 1235, "fn", "meta", None, None, None, x, out, 32, 2.0, 3, 4, 64, False)]
    L(7, x, out, 33, 2.0)  # n no longer a multiple of 16: Triton would compile another kernel
    L(7, x, out, 1, 2.0)  # n == 1: another one again
    L(7, x[1:], out, 32, 2.0)  # x no longer 16-byte aligned
    assert len(fake.compiles) == 4 and len(fake.direct) == 1
    # n past 2**31: Triton types it i64, and a kernel compiled for an i32 n would truncate it
    L(7, x, out, (1 << 31) + 32, 2.0)
    L(7, x, out, (1 << 63) + 32, 2.0)  # u64 from 2**63
    assert len(fake.compiles) == 6 and len(fake.direct) == 1
    L(7, x, out, -(1 << 31) - 16, 2.0)  # another i64 multiple of 16: the kernel of 2**31 + 32
    assert len(fake.compiles) == 6 and len(fake.direct) == 2
    monkeypatch.setattr(triton_compat, "launch_hooks_active", lambda: True)  # a profiler's hook: Triton's path
    L(7, x, out, 32, 2.0)
    assert len(fake.compiles) == 7 and len(fake.direct) == 2


def test_a_varying_constexpr_is_keyed_by_value(monkeypatch):
    """BLOCK 16 and 32 are two kernels, though an integer argument of either would specialise alike
    (both multiples of 16): a launch with BLOCK=32 must not reuse the BLOCK=16 kernel."""
    monkeypatch.setattr(triton_compat, "current_raw_stream", lambda: (lambda index: 0))
    monkeypatch.setattr(triton_compat, "launch_hooks_active", lambda: False)
    fake = _FakeJit()
    L = launch_mod.Launcher(fake, torch.device("cuda", 0), ("x_ptr", "out_ptr", "n", "scale", "BLOCK"), rank=0,
                            WORLD=2)
    x, out = torch.zeros(64), torch.zeros(64)
    L(1, x, out, 16, 1.0, 16)
    L(1, x, out, 16, 1.0, 32)
    assert [c[1]["BLOCK"] for c in fake.compiles] == [16, 32] and fake.direct == []
    L(1, x, out, 16, 1.0, 16)
    assert len(fake.compiles) == 2 and fake.direct[-1][-2] == 16


def test_launcher_names_missing_and_unknown_parameters():
    with pytest.raises(ValueError, match=r"no value for \['rank'\]"):
        launch_mod.Launcher(_kernel, torch.device("cpu"), ("x_ptr", "out_ptr", "n", "scale"), WORLD=4, BLOCK=64)
    with pytest.raises(ValueError, match="not parameters of the kernel: .*'nope'"):
        launch_mod.Launcher(_kernel, torch.device("cpu"), ("x_ptr", "nope"), rank=0, WORLD=4, BLOCK=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_direct_launches_compute_what_triton_launches_compute():
    """On a GPU the direct path runs the kernel Triton compiled for the call's specialisation: every
    n class (1, a multiple of 16, neither) and an unaligned pointer, after a first call of each has
    gone through Triton, give the bits of Triton's own launch (the kernel contracts x * scale + 3
    into one FMA, so torch's two roundings are only close); NaN where nothing was written."""
    dev = torch.device("cuda", torch.cuda.current_device())
    L = launch_mod.Launcher(_kernel, dev, ("x_ptr", "out_ptr", "n", "scale"), rank=1, WORLD=2, BLOCK=64)
    base = torch.randn(80, device=dev)
    for _ in range(3):  # the first round compiles through Triton, the others launch directly
        for n, off in ((64, 0), (33, 0), (1, 0), (48, 1), (17, 3)):
            x = base[off:off + 64]
            out, ref = (torch.full((64,), float("nan"), device=dev) for _ in range(2))
            L(1, x, out, n, 3.0)
            _kernel[(1,)](x, ref, n, 3.0, 1, WORLD=2, BLOCK=64)
            torch.cuda.synchronize()
            assert torch.equal(out[:n], ref[:n]) and out[n:].isnan().all()
            torch.testing.assert_close(out[:n], x[:n] * 3.0 + 3)
    assert len(L.compiled) == 5
